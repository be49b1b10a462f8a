"""The reverse pull through a real mesh (1P+1D, gRPC, UCX): a conversation's later turns, too long for the decode
worker to prefill itself (--pd-direct-max-tokens), go to the prefill worker, which pulls the conversation kept in
the decode worker's prefix cache over the side channel and computes only the new message; an offer whose lease
is gone is computed from scratch instead, with the same answer."""

import time

import httpx
import pytest
from harness import free_port, start_mesh
from test_openai_api import chat_like_the_reference

from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.v1 import common_pb2, decode_pb2, prefill_pb2

pytestmark = pytest.mark.e2e
TOKEN = b"r" * 16


def system_message(topic: str) -> dict:
    """A conversation's system prompt; each test's its own, so that no test finds another's pages in a cache (the
    template's first tokens are shared, but less than a page of them)."""
    return {"role": "system", "content": f"You answer questions about {topic} in short sentences. " * 4}


def worker_counters(port: int) -> dict[str, float]:
    """The worker's Prometheus samples, `name{labels}` -> value."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """One mesh for the module: each test reads the counters' growth over its own requests, so what an earlier
    test left in the caches does not count."""
    port = free_port()
    m = start_mesh(
        str(DEFAULT_MODEL),
        tmp_path_factory.mktemp("reverse-pull"),
        worker_args=["--prefix-cache"],
        http=True,
        role_args={"prefill": ["--metrics-port", str(port)]},
        router_args=["--pd-direct-max-tokens", "4"],
    )
    m.prefill_metrics = port
    try:
        yield m
    finally:
        m.stop()


def grown(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def router_offers(mesh) -> float:
    return worker_counters(mesh.http_port).get('deltamesh_router_pd_decisions_total{path="offered"}', 0)


def test_later_turns_pull_the_conversation_and_compute_only_the_new_message(mesh, reference_engine):
    questions = ["What is a list?", "And a tuple?", "Which one is faster?", "Thanks. What about sets?"]
    before, offers_before = worker_counters(mesh.prefill_metrics), router_offers(mesh)
    prompts, replies = zip(*chat_like_the_reference(mesh, reference_engine, [system_message("Python")], questions))
    # each turn's whole sequence stays on the decode worker, but for its last reply token (never computed) unless
    # that was a stop token, which the engine computes no further than the reply text
    kept = [(p + r - 1, p + r) for p, r in zip(prompts[:-1], replies[:-1])]
    c = worker_counters(mesh.prefill_metrics)
    assert grown(before, c, 'deltamesh_reverse_pulls_total{outcome="ok"}') == len(questions) - 1
    pulled = grown(before, c, 'deltamesh_engine_reverse_pull_tokens_total{role="prefill"}')
    assert sum(lo for lo, _ in kept) <= pulled <= sum(hi for _, hi in kept)
    # turn 1 whole, then each later turn's new message only (its prompt past the previous turn's sequence)
    assert grown(before, c, 'deltamesh_engine_prompt_tokens_total{role="prefill"}') == sum(prompts) - pulled
    assert router_offers(mesh) - offers_before == len(questions) - 1
    assert mesh.wait_idle() == {}


@pytest.mark.parametrize("gone", ["released", "expired"])
def test_an_offer_whose_lease_is_gone_is_computed_from_scratch(mesh, reference_engine, gone):
    messages = [system_message(f"Python's {gone} leases")]
    chat_like_the_reference(mesh, reference_engine, messages, ["What is a list?"])
    messages.append({"role": "user", "content": "And a tuple, and a dict?"})
    prompt = reference_engine.tokenizer.encode_chat(messages)
    [decode], [prefill] = mesh.workers("decode"), mesh.workers("prefill")
    ttl_ms = 1 if gone == "expired" else 0
    offer = decode.stub().OfferPrefix(
        decode_pb2.OfferPrefixRequest(prompt_token_ids=prompt, lease_token=TOKEN, lease_ttl_ms=ttl_ms), timeout=10
    )
    assert offer.layout.num_tokens > len(prompt) // 2  # the first turn's prompt and reply
    if gone == "released":
        release = common_pb2.LeaseRequest(lease_id=offer.lease.lease_id, token=TOKEN)
        assert decode.stub().ReleaseLease(release, timeout=5).ok
    else:
        time.sleep(0.5)
    before = worker_counters(mesh.prefill_metrics)
    source = prefill_pb2.PrefixSource(lease=offer.lease, layout=offer.layout, transport=offer.transport)
    ask = prefill_pb2.PrefillRequest(
        request_id=f"fallback-{gone}",
        prompt_token_ids=prompt,
        prefix=source,
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0),
    )
    answer = prefill.stub().Prefill(ask, timeout=60)
    expected = reference_engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0))[0]
    assert list(answer.first.token_ids) == expected.token_ids[:1]
    after = worker_counters(mesh.prefill_metrics)
    assert grown(before, after, 'deltamesh_reverse_pulls_total{outcome="failed"}') == 1
    assert grown(before, after, 'deltamesh_reverse_pulls_total{outcome="ok"}') == 0
    own = grown(before, after, 'deltamesh_engine_prefix_cache_hit_tokens_total{role="prefill"}')
    computed = grown(before, after, 'deltamesh_engine_prompt_tokens_total{role="prefill"}')
    assert computed == len(prompt) - own  # all but what its own cache held
    release = common_pb2.LeaseRequest(lease_id=ask.request_id, token=answer.lease.token)
    assert prefill.stub().ReleaseLease(release, timeout=5).ok
    assert mesh.wait_idle() == {}
