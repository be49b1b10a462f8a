"""What the step loop (core.py) asks of its scheduler and its prefix cache, declared once.

Each has two implementations: one rank's (scheduler.Scheduler over that rank's pools, prefix_cache.PrefixCache)
and the data-parallel engine's (data_parallel.DataParallelScheduler, DataParallelPrefixCache), which keeps one
of each per rank and answers for all of them. Abstract base classes rather than protocols: an implementation
names what it implements, and one that misses a method fails when it is made, not in the middle of a step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from deltamesh.engine.cache import KVPagePool, StatePool
    from deltamesh.engine.request import Request
    from deltamesh.engine.scheduler import ScheduledItem


class PoolUsage(NamedTuple):
    """KV pages and GDN state slots in use and in all (of every rank, under data parallelism)."""

    kv_pages_used: int
    kv_pages_total: int
    state_slots_used: int
    state_slots_total: int


class SchedulerInterface(ABC):
    """Which requests run in the next step, and the pool space they hold. `reserve` and `cancel` may be called
    from any thread; everything else from the stepping thread."""

    @property
    @abstractmethod
    def running(self) -> Sequence[Request]: ...

    @property
    @abstractmethod
    def waiting(self) -> Sequence[Request]: ...

    @property
    @abstractmethod
    def has_work(self) -> bool: ...

    @property
    @abstractmethod
    def num_preemptions(self) -> int: ...

    @abstractmethod
    def add(self, request: Request) -> None:
        """A new request (or one whose prefix state was placed in its slot and pages: `Request.slot` set)."""

    @abstractmethod
    def add_running(self, request: Request) -> None:
        """A request whose state is already in the pools (received from a prefill worker)."""

    @abstractmethod
    def schedule(self) -> list[ScheduledItem]:
        """The next step's items."""

    @abstractmethod
    def release_snapshot_slots(self, items: list[ScheduledItem]) -> None:
        """Give back the slots a step's items lent for states taken in passing, once the step is queued."""

    @abstractmethod
    def remove(self, req: Request) -> None:
        """Take a request out of the queues (finished or aborted); its state is not freed here."""

    @abstractmethod
    def free(self, req: Request) -> None:
        """Free a request's slot and pages."""

    @abstractmethod
    def reserve(self, num_tokens: int) -> tuple[int, int, list[int]]:
        """(rank, slot, pages) for an arriving `num_tokens` state, nothing written to them; PoolExhausted when
        there is no room."""

    @abstractmethod
    def cancel(self, rank: int, slot: int, pages: list[int]) -> None:
        """Give back a `reserve`'s space."""

    @abstractmethod
    def pools(self, rank: int) -> tuple[KVPagePool, StatePool]:
        """The KV and state pools of `rank` (a data-parallel follower's: the leader's bookkeeping copies)."""

    @abstractmethod
    def usage(self) -> PoolUsage: ...


class PrefixCacheInterface(ABC):
    """What the step loop fills and what the engine reports of a prefix cache."""

    @abstractmethod
    def register(self, req: Request, snapshot_at: int | None = None, snapshot_slot: int | None = None) -> None:
        """Cache what a prompt chunk just launched computes (stepping thread)."""

    @abstractmethod
    def register_finished(self, req: Request) -> None:
        """Cache a finished request's sequence, before its state is freed (stepping thread)."""

    @abstractmethod
    def cached_tokens(self, prompt_ids: list[int]) -> int:
        """How many tokens of this prompt an admission would take from the cache now (any thread)."""

    @abstractmethod
    def resume_keys(self) -> set[int]:
        """The keys (deltamesh/protocol/blocks.py) of the cached prefixes a request can resume after: what a worker
        publishes to its routers for cache-aware routing (any thread)."""

    @abstractmethod
    def reclaimable(self) -> int:
        """KV pages only the cache holds: free on demand."""

    @abstractmethod
    def clear(self) -> None: ...

    @property
    @abstractmethod
    def num_pages(self) -> int: ...

    @property
    @abstractmethod
    def num_checkpoints(self) -> int: ...

    @property
    @abstractmethod
    def num_bytes(self) -> int:
        """What the cache's memory budget counts."""
