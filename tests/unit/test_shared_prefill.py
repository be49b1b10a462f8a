"""One prefill for prompts that arrive together (engine/shared_prefill.py): a waiting request whose prompt shares a
prefix with a running prefill, up to a checkpoint it has yet to reach, waits for it and then starts from the cache,
token for token as without the cache; prompts with nothing to share, or asking for their prompt's logprobs, are
not held."""

import pytest
from test_prefix_cache import GREEDY, SEEDED, compare, core, run_waves, tokens

from deltamesh.engine import SamplingParams, shared_prefill

PROMPT = tokens(101, 11)  # its checkpoint: 100, the last page boundary before its last token (pages of 4)
BUDGET = dict(max_num_batched_tokens=512, max_num_seqs=8, num_kv_pages=256)  # four such prompts fit one step


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_n_copies_of_a_prompt_compute_it_once(hf_checkpoints, params):
    engine = compare(hf_checkpoints["qwen3_5"], [[PROMPT] * 4], params, expect_hit_tokens=3 * 100, **BUDGET)
    assert engine.stats.prefix_cache_hits == 3


def test_without_the_wait_they_share_one_step_and_compute_it_four_times(hf_checkpoints, monkeypatch):
    monkeypatch.setattr(shared_prefill, "MIN_SHARED_TOKENS", 10**9)
    compare(hf_checkpoints["qwen3_5"], [[PROMPT] * 4], GREEDY, expect_hit_tokens=0, **BUDGET)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_a_shared_system_prefix_is_computed_once_where_a_checkpoint_falls_in_it(hf_checkpoints, family):
    system = tokens(82, 12)
    prompts = [system + tokens(20, 20 + i) for i in range(3)]
    # checkpoints every 20 pages (80 tokens): the first prompt's at 80 lies in the shared 82 tokens
    engine = compare(hf_checkpoints[family], [prompts], GREEDY, state_checkpoint_interval=20, **BUDGET)
    assert engine.stats.prefix_cache_hit_tokens == 2 * 80


def test_unrelated_prompts_and_prompt_logprobs_are_not_held(hf_checkpoints, monkeypatch):
    model = hf_checkpoints["qwen3_5"]
    compare(model, [[tokens(101, 30 + i) for i in range(3)]], GREEDY, expect_hit_tokens=0, **BUDGET)
    engine = core(model, True, **BUDGET)
    verdicts = []

    rule = shared_prefill.waits_for_a_prefill

    def spy(req, running, cache):
        verdicts.append((req.request_id, rule(req, running, cache)))
        return verdicts[-1][1]

    monkeypatch.setattr(shared_prefill, "waits_for_a_prefill", spy)
    with_logprobs = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    for rid, params in (("first", GREEDY), ("logprobs", with_logprobs), ("copy", GREEDY)):
        engine.submit(engine.make_request(PROMPT, params, rid), lambda o: None)
    engine.dispatch(engine.process_commands())
    while engine.has_work or engine.requests:
        engine.dispatch(engine.step())
        engine.dispatch(engine.process_commands())
    assert ("copy", True) in verdicts and ("logprobs", True) not in verdicts, verdicts
    assert engine.stats.prefix_cache_hit_tokens == 100  # the copy's; the logprobs request computed its prompt


def test_a_burst_of_one_prompt_holds_at_most_max_held_and_keeps_its_order(hf_checkpoints):
    """Twenty copies: the first computes the prompt, sixteen wait for it, the rest wait behind them in the queue;
    all nineteen then start from the cache."""
    budget = dict(BUDGET, max_num_seqs=24, num_kv_pages=1024)
    assert shared_prefill.MAX_HELD == 16
    compare(hf_checkpoints["qwen3_5"], [[PROMPT] * 20], GREEDY, expect_hit_tokens=19 * 100, **budget)


def test_n_choices_of_a_chat_start_from_its_last_page():
    """A chat prompt that finishes here keeps no checkpoint at its end (its finished sequence serves the next turn);
    with copies of it waiting (n > 1 choices of a chat) the first keeps one, and the copies start there."""
    from deltamesh.engine import DEFAULT_MODEL, EngineConfig
    from deltamesh.engine.core import EngineCore
    from deltamesh.engine.tokenizer import Tokenizer

    chat = [
        {"role": "system", "content": "You are a careful assistant who answers in short sentences. " * 2},
        {"role": "user", "content": "Name three uses of a tuple, and say why each one helps. " * 8},
    ]
    prompt = Tokenizer(DEFAULT_MODEL).encode_chat(chat)
    kw = dict(page_size=16, max_num_seqs=8, num_kv_pages=128)
    plain = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), prefix_cache=False, **kw))
    engine = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), prefix_cache=True, **kw))
    assert run_waves(engine, [[prompt] * 4], GREEDY) == run_waves(plain, [[prompt] * 4], GREEDY)
    assert engine.stats.prefix_cache_hit_tokens == 3 * ((len(prompt) - 1) // 16 * 16)
