"""Which requests skip the prefill worker. A decode worker with --prefix-cache keeps each finished request's
whole sequence (prompt and reply, engine/prefix_cache.py), so a conversation's next turn, which re-sends it, has
only its new message left to compute there. When some decode worker holds all but at most `max_suffix` tokens of
a prompt, the request goes to it directly (it prefills the rest itself, as a colocated worker does) instead of
through a prefill worker that would recompute the previous reply and move the whole state.

What each decode worker holds is what it reports (router/prefix_index.py: every router process learns it alike)
and, until its next report, what this process saw it finish (policies.SentBlocks, named the way its cache names
them). The worker's cache may have evicted a sequence since: it then refuses the request (more than
`max_suffix` tokens uncached), which goes through a prefill worker after all, so a decode worker never prefills
a long prompt.

A request that goes through a prefill worker after all (its new message is longer than `max_suffix`) still need
not recompute the conversation: `holder` names the decode worker that holds the longest prefix of it, which the
mesh asks to offer that prefix to the prefill worker (the reverse pull, mesh.py)."""

from __future__ import annotations

from collections.abc import Sequence

from deltamesh.services.router import metrics
from deltamesh.services.router.load_order import as_pool
from deltamesh.services.router.policies import Candidates, SentBlocks, longest_held
from deltamesh.services.router.prefix_index import PrefixIndex
from deltamesh.services.router.registry import WorkerHandle


class PdDecider:
    def __init__(self, max_suffix: int, block: int = 16, max_blocks: int = 1 << 18, index: PrefixIndex | None = None):
        self.max_suffix = max_suffix
        self.held = SentBlocks(block, max_blocks)  # the sequences each decode worker finished (here)
        self.index = index  # what the workers report their caches hold

    def direct(self, decode_workers: Candidates, prompt_ids: Sequence[int]) -> WorkerHandle | None:
        """The decode worker to send this prompt to directly, or None (through a prefill worker)."""
        best, matched = self.holder(decode_workers, prompt_ids)
        go = best is not None and len(prompt_ids) - matched <= self.max_suffix
        metrics.PD_DECISIONS.labels("direct" if go else "prefill").inc()
        return best if go else None

    def holder(self, decode_workers: Candidates, prompt_ids: Sequence[int]) -> tuple[WorkerHandle | None, int]:
        """The decode worker that finished the longest prefix of this prompt (with a prefix cache that keeps it; the
        least loaded of those that hold as much), and how many tokens of it (whole blocks); (None, 0) when none
        did."""
        keys = self.held.keys(prompt_ids)
        # a worker without a prefix cache keeps nothing: it would compute the whole prompt
        best, matched = longest_held(
            as_pool(decode_workers), keys, self.index, self.held, lambda w: w.load is not None and w.load.prefix_cache
        )
        return best, matched * self.held.block

    def finished(self, address: str, sequence: Sequence[int]) -> None:
        """A request's prompt and reply, finished on decode worker `address`."""
        self.held.remember(address, self.held.keys(sequence))

    def refused(self) -> None:
        """A decode worker did not hold a conversation it was thought to: counted; the request goes through
        prefill (and the decode worker it lands on holds the conversation again once it finishes)."""
        metrics.PD_DECISIONS.labels("refused").inc()

    def forget(self, address: str) -> None:
        """A worker that failed lost its cache."""
        self.held.forget(address)
