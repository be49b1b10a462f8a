"""bench/serve.py sends vllm bench serve's sampling flags with every request, under their API names, to the REST
and the gRPC backends alike (how TPOT with penalties on every request is measured: bench/RESULTS.md)."""

from bench import serve


def test_sampling_flags_go_into_every_request():
    args = serve.parse_args(
        ["--backend", "openai", "--presence-penalty", "1.5", "--repetition-penalty", "1.1", "--top-k", "-1"]
    )
    wanted = {"temperature": 0.0, "presence_penalty": 1.5, "repetition_penalty": 1.1, "top_k": -1}
    assert serve.sampling(args) == wanted
    body = serve.OpenAIBackend(args).payload(serve.SampleRequest([1, 2, 3], 3, 8), args)
    assert body | wanted == body and body["max_tokens"] == 8
    plain = serve.parse_args(["--backend", "openai"])
    assert serve.sampling(plain) == {"temperature": 0.0}
