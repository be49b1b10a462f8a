"""The rules the router's two edges share (request ids, stop strings, a chat's tool_choice), the abort tokens, and the secret files, in
process; tests/e2e/test_edge_attacks.py and test_attacks.py send the same attacks to real processes."""

import enum
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltamesh.protocol.requests import RequestError, validate_request
from deltamesh.protocol.sampling import SamplingParams
from deltamesh.services.common.auth import MissingSecret, load_mesh_secret, read_secret_file
from deltamesh.services.common.logs import MAX_REQUEST_ID_CHARS, request_id_problem
from deltamesh.services.router.chat_request import ChatRequest
from deltamesh.services.router.limits import MAX_STOP_BYTES, MAX_STOP_CHARS, InvalidParam, check_stop
from deltamesh.services.router.openai_schema import CompletionRequest
from deltamesh.services.router.servicer import AbortTokens
from deltamesh.v1 import router_pb2

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rid", ["job-42", "chatcmpl-0f3a-7", "a" * MAX_REQUEST_ID_CHARS, "x!~{}|/:.=+"])
def test_request_ids_of_printable_ascii_are_taken(rid):
    assert request_id_problem(rid) is None


@pytest.mark.parametrize(
    "rid", ["", "a\nb", "a\0b", "caf\u00e9", "two words", "tab\there", "a" * (MAX_REQUEST_ID_CHARS + 1), "x" * 5000]
)
def test_other_request_ids_are_refused_without_echoing_them(rid):
    problem = request_id_problem(rid)
    assert problem and problem.startswith("request_id must")
    assert len(problem) < 120  # never the id itself


def test_the_largest_done_notice_a_request_can_cause_fits_its_limit():
    """A notice that does not fit is dropped by the holder, whose slots then stay held for the lease's TTL: the
    request id (the lease id) is the only part of it a client chooses."""
    from deltamesh.transfer.ucx import notices
    from deltamesh.v1 import ucx_pb2

    notice = ucx_pb2.PullNotice(lease_id="~" * MAX_REQUEST_ID_CHARS, token=b"\xff" * 64, abandon=True, done=True)
    assert len(notices.frame(notice)) <= notices.MAX_NOTICE_BYTES


def refusal(stop) -> str:
    with pytest.raises(InvalidParam) as e:
        check_stop(stop)
    assert e.value.param == "stop"
    return str(e.value)


def test_stop_strings_are_bounded_in_count_length_and_bytes():
    check_stop(["\n\nUser:", "</answer>", "x" * MAX_STOP_CHARS])
    assert refusal(["a"] * 17) == "too many stop strings: 17 (this server takes at most 16 per request)"
    assert refusal(["x" * (4 << 20)]) == f"a stop string has {4 << 20} characters; at most {MAX_STOP_CHARS}"
    over = ["x" * 1000] * 4 + ["\u00e9" * 100]  # 4,200 bytes in UTF-8
    assert refusal(over) == f"the stop strings take 4200 bytes (UTF-8) together; at most {MAX_STOP_BYTES}"
    assert "non-empty" in refusal(["ok", ""])
    assert "lone surrogate" in refusal(["a\ud800"])


def test_grpcs_tool_choice_reads_as_rests_and_is_refused_in_rests_words():
    ask = [router_pb2.ChatMessage(role="user", content="hi")]
    tool = router_pb2.Tool(name="f", parameters='{"type": "object"}')
    modes = router_pb2.ToolChoice

    def chat(**kw) -> ChatRequest:
        return ChatRequest.from_proto(router_pb2.ChatMessages(messages=ask, **kw))

    assert (chat().tool_choice, chat(tools=[tool]).tool_choice) == ("none", "auto")  # OpenAI's defaults
    assert chat(tools=[tool], tool_choice=modes(mode=modes.MODE_UNSPECIFIED)).tool_choice == "auto"
    assert chat(tools=[tool], tool_choice=modes(mode=modes.MODE_NONE)).tool_choice == "none"
    assert chat(tools=[tool], tool_choice=modes(mode=modes.MODE_REQUIRED)).tool_choice == "required"
    assert chat(tools=[tool], tool_choice=modes(function="f")).tool_choice == {"name": "f"}
    assert chat().parallel_tool_calls and not chat(parallel_tool_calls=False).parallel_tool_calls
    for request, words in (
        (chat(tools=[tool], tool_choice=modes(mode=7)), "tool_choice must be none, auto, required or a named"),
        (chat(tool_choice=modes(function="f")), "tool_choice names a function, but the request has no tools"),
        (chat(tools=[tool], tool_choice=modes(function="g")), "tool_choice names the function 'g', not in tools"),
        (chat(tool_choice=modes(mode=modes.MODE_REQUIRED)), 'tool_choice "required" needs tools'),
    ):
        with pytest.raises(InvalidParam, match=words) as refused:
            request.check()
        assert refused.value.param == "tool_choice"
    with pytest.raises(InvalidParam, match="parameters must be a JSON Schema object"):
        chat(tools=[router_pb2.Tool(name="f", parameters="[1]")])


def test_an_abort_token_names_one_run_of_a_request():
    tokens = AbortTokens()
    nonce, token = tokens.issue("job-42")
    assert tokens.nonce("job-42", token) == nonce
    later_nonce, _ = tokens.issue("job-42")  # the same id run again: another nonce, which the old token lacks
    assert later_nonce != nonce and tokens.nonce("job-42", token) != later_nonce
    assert tokens.nonce("job-43", token) is None  # another request's
    assert tokens.nonce("job-42", token[:-1] + bytes([token[-1] ^ 1])) is None  # forged
    assert tokens.nonce("job-42", b"") is None and tokens.nonce("job-42", nonce) is None
    assert AbortTokens().nonce("job-42", token) is None  # another router's key


@pytest.mark.parametrize("mode,refused", [(0o600, False), (0o644, False), (0o620, True), (0o602, True), (0o666, True)])
def test_a_secret_file_others_may_write_is_refused(tmp_path, mode, refused):
    path = tmp_path / "secret"
    path.write_text("s" * 32 + "\n")
    path.chmod(mode)
    if not refused:
        assert read_secret_file(str(path), "mesh secret") == "s" * 32
        assert load_mesh_secret(str(path)) == "s" * 32
        return
    with pytest.raises(MissingSecret) as e:
        load_mesh_secret(str(path))
    message = str(e.value)
    assert "\n" not in message and f"chmod go-w {path}" in message and "writable by" in message


def router(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """`deltamesh router` with a model directory that does not exist: it exits (78) once its options are read."""
    argv = ["router", "--model", "/no/such/model", "--grpc-port", "0", "--control-port", "0", "--http-port", "0"] + argv
    return subprocess.run(
        [sys.executable, "-m", "deltamesh.services.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "DELTAMESH_MESH_SECRET": "s" * 32, **env},
    )


def test_the_api_key_comes_from_a_file_or_the_environment_and_a_command_line_key_is_warned_about(tmp_path):
    warning = "--api-key on the command line can be read by every user"
    on_command_line = router(["--api-key", "k" * 20], {})
    assert on_command_line.returncode == 78 and warning in on_command_line.stderr, on_command_line.stderr
    from_env = router([], {"DELTAMESH_API_KEY": "k" * 20})
    assert from_env.returncode == 78 and warning not in from_env.stderr, from_env.stderr
    key_file = tmp_path / "key"
    key_file.write_text("k" * 20)
    key_file.chmod(0o600)
    from_file = router(["--api-key-file", str(key_file)], {})
    assert from_file.returncode == 78 and warning not in from_file.stderr, from_file.stderr
    both = router(["--api-key-file", str(key_file), "--api-key", "k" * 20], {})
    assert both.returncode == 2 and "give the API key once" in both.stderr
    key_file.chmod(0o666)
    writable = router(["--api-key-file", str(key_file)], {})
    assert writable.returncode == 2 and f"chmod go-w {key_file}" in writable.stderr, writable.stderr
    os.unlink(key_file)


def test_a_requests_choices_start_in_turn_within_both_bounds():
    """gateway/fanout.py: prompt tokens waiting for a first token stay within the budget (a longer prompt goes
    alone), choices in the mesh within their count; each start waits for what frees room."""
    import asyncio

    from deltamesh.services.router.gateway.fanout import Fanout

    async def scenario():
        fanout = Fanout(running=3, prefill_tokens=100)

        async def starts(tokens: int) -> bool:  # does a choice of `tokens` start without anything ending first?
            task = asyncio.ensure_future(fanout.start(tokens))
            await asyncio.sleep(0)
            if task.done():
                return True
            task.cancel()
            return False

        assert await starts(60) and await starts(40)  # 100 tokens waiting: the budget
        assert not await starts(1)
        fanout.prefilled(60)  # a first token frees its prompt's share
        assert await starts(50)
        assert (fanout.running, fanout.prefilling, fanout.prefill_tokens) == (3, 2, 90)
        fanout.prefilled(40)
        fanout.prefilled(50)
        assert not await starts(1)  # nothing waits for a first token, but three choices run: the count bounds
        fanout.ended()
        assert await starts(500)  # longer than the budget: it goes, alone
        fanout.ended()
        assert not await starts(1)
        waiting = asyncio.ensure_future(fanout.start(1))
        await asyncio.sleep(0)
        fanout.prefilled(500)  # what the waiting start needed: it starts without being asked again
        await asyncio.wait_for(waiting, 1)

    asyncio.run(scenario())


class _TokenKind(enum.IntEnum):
    SEVEN = 7


@pytest.mark.parametrize(
    "ids, ok",
    [
        ([0, 5, 9], True),
        ([_TokenKind.SEVEN, 3], True),  # an int subclass other than bool is an integer proper
        ([1, True], False),  # JSON's true is not a token
        ([1, 2.0], False),
        ([1, "2"], False),
        ([1, None], False),
        ([-1, 3], False),
        ([3, 10], False),  # vocab_size 10: ids in [0, 10)
    ],
)
def test_prompt_token_ids_are_integers_proper_inside_the_vocabulary(ids, ok):
    params = SamplingParams(max_tokens=1)
    if ok:
        validate_request(ids, params, vocab_size=10, max_model_len=64)
    else:
        with pytest.raises(RequestError, match=r"prompt token ids must be integers in \[0, 10\)"):
            validate_request(ids, params, vocab_size=10, max_model_len=64)


@pytest.mark.parametrize(
    "prompt, kind",
    [
        ([3, 1, 4], int),
        ([[3, 1], [4]], list),
        ("three", str),
        (["a", "b"], str),
    ],
)
def test_a_completion_prompt_keeps_its_shape_whichever_the_unions_order(prompt, kind):
    """Token ids come first in the schema's union (pydantic's smart union validates them 6x faster so): each of
    the four shapes still reads as itself, and a mixed list is refused."""
    body = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert body.prompt == prompt
    assert isinstance(body.prompt if isinstance(prompt, str) else body.prompt[0], kind)
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"model": "m", "prompt": [1, "a"]})
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"model": "m", "prompt": [True, 2]})
