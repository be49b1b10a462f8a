"""A stream that falls behind takes what piled up as one output (engine) or one event (gateway): every token,
text and logprob in order, the finish last, and fewer messages than tokens."""

import asyncio
import time

from deltamesh.engine import Engine, EngineConfig, SamplingParams
from deltamesh.services.router.gateway.generation import _merged
from deltamesh.v1 import common_pb2


def test_an_engine_stream_that_falls_behind_gets_its_outputs_merged(hf_checkpoints):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)

    async def consume(engine):
        outs = []
        async for out in engine.generate_stream([5, 6, 7], params):
            outs.append(out)
            time.sleep(0.1)  # blocks the event loop while the stepping thread goes on
        return outs

    with Engine(EngineConfig(model=str(hf_checkpoints["qwen3_5"]))) as engine:
        ref = engine.generate([[5, 6, 7]], params)[0]
        outs = asyncio.run(consume(engine))
    assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
    assert [lp.token_id for o in outs for lp in o.logprobs] == ref.token_ids
    assert "".join(o.new_text for o in outs) == ref.text
    assert len(outs) < len(ref.token_ids)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].num_output_tokens == 30 and outs[-1].finish_reason == ref.finish_reason


def delta(tokens, text, done=False):
    d = common_pb2.TokenDelta(
        token_ids=tokens,
        text=text,
        finished=done,
        usage=common_pb2.Usage(prompt_tokens=4, completion_tokens=tokens[-1]),
    )
    d.logprobs.add(token_id=tokens[0], logprob=-0.5)
    if done:
        d.finish_reason, d.stop_token_id = common_pb2.FINISH_REASON_STOP, tokens[-1]
    return d


def test_the_gateway_merges_each_choices_waiting_deltas():
    queue = asyncio.Queue()
    waiting = [
        (1, delta([1], "a")),
        (0, delta([2], "x")),
        (0, delta([3], "y", done=True)),
        (0, None),
        (1, delta([4], "b")),
        (1, "an error"),
        (1, delta([5], "c")),
    ]
    for item in waiting[1:]:
        queue.put_nowait(item)
    out = _merged([waiting[0]], queue)
    assert queue.empty()
    assert [(i, type(x).__name__) for i, x in out] == [
        (1, "TokenDelta"),
        (0, "TokenDelta"),
        (0, "NoneType"),
        (1, "str"),
        (1, "TokenDelta"),
    ]
    one, zero, last = out[0][1], out[1][1], out[4][1]
    assert list(one.token_ids) == [1, 4] and one.text == "ab" and not one.finished
    assert [lp.token_id for lp in one.logprobs] == [1, 4] and one.usage.completion_tokens == 4
    assert list(zero.token_ids) == [2, 3] and zero.text == "xy" and zero.finished
    assert zero.finish_reason == common_pb2.FINISH_REASON_STOP and zero.stop_token_id == 3
    assert list(last.token_ids) == [5]  # after the error: not merged across it
