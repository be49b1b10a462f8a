"""The SDK's two clients: generate and stream take build_request's sampling keywords through `**kwargs` (their
docstring names every one, an unknown keyword is refused naming it and those taken, no request is sent), and the
sync and async clients build the same requests and raise the same errors. Real gRPC channels to a closed port
(no router): what is checked here happens before or instead of an answer."""

import asyncio

import pytest

from deltamesh.client import AsyncClient, Client, Delta, InvalidRequest, Result, ToolCall, Unavailable, build_request
from deltamesh.client.client import _KEYWORDS, _request
from deltamesh.v1 import common_pb2, router_pb2


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


def test_a_chats_tool_choice_travels_in_openais_shapes_and_others_are_refused():
    ask = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f"}}
    default = build_request(ask, tools=[tool]).chat
    assert not default.HasField("tool_choice") and not default.HasField("parallel_tool_calls")
    required = build_request(ask, tools=[tool], tool_choice="required", parallel_tool_calls=False).chat
    assert required.tool_choice.mode == router_pb2.ToolChoice.MODE_REQUIRED and required.parallel_tool_calls is False
    named = build_request(ask, tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}).chat
    assert named.tool_choice.WhichOneof("choice") == "function" and named.tool_choice.function == "f"
    for bad in ("sometimes", {"name": "f"}, {"type": "function", "function": {}}):
        with pytest.raises(InvalidRequest, match="tool_choice must be"):
            build_request(ask, tools=[tool], tool_choice=bad)
    with pytest.raises(InvalidRequest, match="chat messages only"):
        build_request("hi", tool_choice="auto")


def test_a_results_chat_reply_is_the_sum_of_its_deltas():
    def delta(chat: router_pb2.ChatDelta, finished=False) -> Delta:
        return Delta.from_proto("r", common_pb2.TokenDelta(text="t", finished=finished), chat)

    result = Result("r")
    result.add(delta(router_pb2.ChatDelta(reasoning="think", content="a")))
    header = router_pb2.ToolCallDelta(index=0, id="call_1", name="f", arguments='{"x": ')
    result.add(delta(router_pb2.ChatDelta(content="b", tool_calls=[header])))
    second = router_pb2.ToolCallDelta(index=1, id="call_2", name="g", arguments="{}")
    pieces = [router_pb2.ToolCallDelta(index=0, arguments="1}"), second]
    result.add(delta(router_pb2.ChatDelta(tool_calls=pieces), finished=True))
    assert (result.text, result.reasoning, result.content) == ("ttt", "think", "ab")
    assert result.tool_calls == [ToolCall("call_1", "f", '{"x": 1}'), ToolCall("call_2", "g", "{}")]
    plain = Result("r")
    plain.add(Delta.from_proto("r", common_pb2.TokenDelta(text="t")))
    assert (plain.text, plain.content, plain.tool_calls) == ("t", "", [])  # not a chat: the text alone


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


def test_stop_reason_is_rests_the_stop_string_or_a_requested_stop_token():
    """The wire names the end-of-sequence token that ended a request too; the SDK reads it as REST does (None)."""
    eos = common_pb2.TokenDelta(finished=True, finish_reason=common_pb2.FINISH_REASON_STOP, stop_token_id=2)
    assert Delta.from_proto("r", eos).stop_reason is None
    assert Delta.from_proto("r", eos, stop_token_ids=frozenset({2, 9})).stop_reason == 2
    text = common_pb2.TokenDelta(finished=True, finish_reason=common_pb2.FINISH_REASON_STOP, stop_string="##")
    assert Delta.from_proto("r", text).stop_reason == "##"
