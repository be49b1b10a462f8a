"""Speculative decoding with the prefix cache: a conversation's next turn starts from the state the previous turn
left, which must be exactly the state of its tokens, never a draft's (an accepted run that went past the reply's
end, or a step launched before the end was read); stop strings, which the device cannot see, end the text where
they do without MTP."""

import pytest
from hf_checkpoints import VOCAB
from spec_drafts import ReferenceDrafter
from test_spec_engine import engine, prompts, run

from deltamesh.engine import DEFAULT_MODEL, SamplingParams

pytestmark = pytest.mark.spec


def second_turns(path, k, ps, params, follow, drafter=None, **kw):
    """Each prompt's reply, then a next turn (prompt + reply + `follow`) on the same engine: (replies, next
    replies, prefix-cache hit tokens of the next turns)."""
    core = engine(path, k, **kw)
    if drafter is not None:
        core.runner.spec.drafter = drafter
    first = run(core, ps, params)
    hits = core.stats.prefix_cache_hit_tokens
    turns = [p + first[f"r{i}"] + follow for i, p in enumerate(ps)]
    second = run(core, turns, params, ids=[f"t{i}" for i in range(len(ps))])
    return first, second, core.stats.prefix_cache_hit_tokens - hits


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_next_turn_from_a_reply_whose_accepted_run_ended_on_a_stop_token(hf_checkpoints, async_scheduling):
    """Every draft is the reference continuation (so a run is accepted past where the reply stops), and a stop
    token ends each reply inside such a run: the next turns, started from the cached replies, still give the
    tokens of an engine without MTP."""
    path, ps = hf_checkpoints["qwen3_5_moe"], prompts(3, seed=4)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain_first = run(engine(path, 0), ps, greedy)
    stop = [plain_first[f"r{i}"][6 + 3 * i] for i in range(3)]  # a token well inside each reply
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=stop)
    follow = [5, 6, 7, 8, 9]
    want = second_turns(path, 0, ps, params, follow)
    # drafts: each reply's continuation past its stop token, and each next turn's reply
    refs = {f"r{i}": p + plain_first[f"r{i}"] for i, p in enumerate(ps)}
    refs |= {f"t{i}": p + want[0][f"r{i}"] + follow + want[1][f"t{i}"] for i, p in enumerate(ps)}
    drafter = ReferenceDrafter(refs, VOCAB)
    got = second_turns(path, 3, ps, params, follow, drafter, async_scheduling=async_scheduling)
    assert got[:2] == want[:2]
    assert got[2] >= sum(len(p) + len(r) - 1 for p, r in zip(ps, got[0].values()))  # each turn's whole state hit


def test_stop_strings_end_the_text_where_they_do_without_mtp():
    """The default model (a tokenizer: stop strings), drafting with its trained MTP module."""
    tiny_mtp = DEFAULT_MODEL
    plain = engine(tiny_mtp, 0)
    prompt = plain.tokenizer.encode("The Python language")
    reply = run(plain, [prompt], SamplingParams(max_tokens=30, temperature=0))["r0"]
    text = plain.tokenizer.decode(reply)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=30, temperature=0, stop=[stop])
    want = second_turns(tiny_mtp, 0, [prompt], params, [11, 12, 13])
    for k in (1, 3):
        got = second_turns(tiny_mtp, k, [prompt], params, [11, 12, 13])
        assert got[:2] == want[:2]
