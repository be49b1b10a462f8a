"""The SDK's two clients: generate and stream take build_request's sampling keywords through `**kwargs` (their
docstring names every one, an unknown keyword is refused naming it and those taken, no request is sent), and the
sync and async clients build the same requests and raise the same errors. Real gRPC channels to a closed port
(no router): what is checked here happens before or instead of an answer."""

import asyncio

import pytest

from deltamesh.client import AsyncClient, Client, InvalidRequest, Unavailable, build_request
from deltamesh.client.client import _KEYWORDS, _request


def test_generate_names_its_keywords_and_refuses_unknown_ones():
    assert all(name in Client.generate.__doc__ for name in _KEYWORDS)
    with Client("127.0.0.1:1", retries=0, timeout=1) as client:
        for call in (client.generate, client.stream):
            with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) n;.*max_tokens, temperature"):
                call("hi", n=2, max_tokens=3)

    async def refused():
        async with AsyncClient("127.0.0.1:1", retries=0, timeout=1) as client:
            with pytest.raises(TypeError, match="unknown keyword argument"):
                await client.generate("hi", best_of=2)
            with pytest.raises(TypeError, match="unknown keyword argument"):
                client.stream("hi", best_of=2)

    asyncio.run(refused())


def test_requests_carry_the_prompt_kind_and_only_the_sampling_fields_set():
    text = build_request("hi", max_tokens=3, temperature=0, stop=["x"], request_id="r")
    assert text.WhichOneof("prompt") == "text" and text.text == "hi" and text.request_id == "r"
    assert text.sampling.HasField("temperature") and not text.sampling.HasField("top_p")
    assert list(text.stop.stop) == ["x"] and text.sampling.max_tokens == 3
    assert build_request([5, 6]).token_ids.ids == [5, 6]
    chat = build_request([{"role": "user", "content": "hi"}])
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "hi")]
    assert build_request("a").request_id != build_request("a").request_id  # a fresh id when none is given
    for bad in (dict(max_tokens=-1), dict(stop_token_ids=[2**32]), dict(seed=-1)):
        with pytest.raises(InvalidRequest, match="invalid request"):
            build_request("hi", **bad)
    assert _request("hi", dict(max_tokens=3, request_id="r")) == build_request("hi", max_tokens=3, request_id="r")


def test_both_clients_raise_the_same_errors_without_a_router():
    """A closed port: every call is UNAVAILABLE once its retries are spent (retried, never another error); input
    the protocol cannot carry is InvalidRequest from both, before any call."""
    address = "127.0.0.1:1"  # a privileged port no test listens on

    def sync_errors():
        out = []
        with Client(address, retries=1, timeout=5) as client:
            for call in (
                lambda: client.generate("hi", max_tokens=2),
                lambda: list(client.stream("hi", max_tokens=2)),
                lambda: client.list_models(),
                lambda: client.abort("r", b"t"),
                lambda: client.generate("hi", max_tokens=-1),
            ):
                with pytest.raises((Unavailable, InvalidRequest)) as e:
                    call()
                out.append((type(e.value), e.value.code))
        return out

    async def async_errors():
        out = []
        async with AsyncClient(address, retries=1, timeout=5) as client:

            async def drain():
                return [d async for d in client.stream("hi", max_tokens=2)]

            for call in (
                lambda: client.generate("hi", max_tokens=2),
                drain,
                lambda: client.list_models(),
                lambda: client.abort("r", b"t"),
                lambda: client.generate("hi", max_tokens=-1),
            ):
                with pytest.raises((Unavailable, InvalidRequest)) as e:
                    await call()
                out.append((type(e.value), e.value.code))
        return out

    errors = sync_errors()
    assert [kind for kind, _ in errors] == [Unavailable] * 4 + [InvalidRequest]
    assert asyncio.run(async_errors()) == errors
