"""One prefill for prompts that arrive together: a waiting request whose prompt shares a prefix with a request that
is still prefilling, up to a checkpoint that request has yet to reach, waits for it instead of computing the same
prefix beside it in the same steps; then it starts from that checkpoint in the prefix cache (prefix_cache.py).
That is n > 1 choices of one prompt (vLLM forks them after one prefill), a burst of chats with one system prompt,
or any client sending a prompt twice at once. A prefix the cache already holds, or one too short to pay for a
step's wait (MIN_SHARED_TOKENS), does not hold a request back; nor does anything once the running request has
passed its checkpoint (it skipped it: a full batch with no state slot to keep it in)."""

from __future__ import annotations

from collections.abc import Iterable

from deltamesh.engine.prefix_cache import PrefixCache
from deltamesh.engine.request import Request

# A wait costs the waiting request about one step before its first token; a prefix shorter than this is computed
# again instead (four pages of 16 tokens: where a step's time starts to grow with its tokens on a GPU).
MIN_SHARED_TOKENS = 64
# Waiting requests held at once: past these the queue's order holds the rest (a burst of one long prompt would
# otherwise cost a look at every one of them, each step, while the first prefills).
MAX_HELD = 16


def _common_tokens(a: Request, b: Request, page_size: int) -> int:
    """How many leading prompt tokens `a` and `b` share, counted by their block keys (each names its whole
    prefix), then token by token into the first block that differs."""
    keys_a, keys_b = a.block_keys, b.block_keys
    blocks = 0
    for key_a, key_b in zip(keys_a, keys_b):
        if key_a != key_b:
            break
        blocks += 1
    start = blocks * page_size
    n = start
    for x, y in zip(a.prompt_ids[start : start + page_size], b.prompt_ids[start : start + page_size]):
        if x != y:
            break
        n += 1
    return n


def _next_checkpoint(cache: PrefixCache, running: Request, limit: int) -> int:
    """The farthest checkpoint position at most `limit` that `running` has still to reach (0: none)."""
    best, after = 0, running.num_computed
    while (stop := cache.positions.next_stop(running, after=after)) is not None and stop <= limit:
        best, after = stop, stop
    return best


def waits_for_a_prefill(req: Request, running: Iterable[Request], cache: PrefixCache) -> bool:
    """Whether `req` (waiting, nothing of it computed) should let a running prefill reach a checkpoint of a
    prefix they share before it is admitted."""
    if req.params.prompt_logprobs is not None or req.num_computed or req.slot is not None:
        return False  # it computes its whole prompt anyway, or it resumes what it already holds
    page_size = cache.kv_pool.page_size
    limit = len(req.prompt_ids) - 1  # a request computes at least its last prompt token
    gain = 0
    for other in running:
        if other.num_computed >= len(other.prompt_ids) or other.params.prompt_logprobs is not None:
            continue  # decoding already (its checkpoints are in the cache), or not caching its prompt
        if not other.block_keys or not other.prompt_ids or other.prompt_ids[0] != req.prompt_ids[0]:
            continue  # the common case, decided without hashing req's prompt
        if not req.block_keys:
            cache.hit_tokens(req)  # computes and keeps req's block keys (admission needs them next anyway)
        shared = _common_tokens(req, other, page_size)
        if shared >= MIN_SHARED_TOKENS:
            gain = max(gain, _next_checkpoint(cache, other, min(shared, limit)))
    return gain >= MIN_SHARED_TOKENS and gain - cache.hit_tokens(req) >= MIN_SHARED_TOKENS


def keep_prompt_checkpoint(req: Request, waiting: Iterable[Request], cache: PrefixCache) -> None:
    """`req` was just admitted. A chat prompt that finishes on this worker keeps no checkpoint at its end (its
    finished sequence serves its next turn, checkpoint_positions.py); when a waiting request has the same prompt up
    to there (n > 1 choices of a chat), `req` keeps one all the same, for that request to start from."""
    page_size = cache.kv_pool.page_size
    end = (len(req.prompt_ids) - 1) // page_size * page_size
    if not req.turn_end or req.hold_state or end < MIN_SHARED_TOKENS or req.num_computed >= end:
        return
    for other in waiting:
        if other.prompt_ids[0] != req.prompt_ids[0] or other.params.prompt_logprobs is not None or other.num_computed:
            continue
        if not other.block_keys:
            cache.hit_tokens(other)  # computes and keeps its block keys
        if _common_tokens(req, other, page_size) >= end:
            req.keeps_prompt_checkpoint = True
            return
