"""The ranks of a tensor-parallel or data-parallel engine beyond the first.

The worker's own process is rank 0, the leader: it schedules, samples and talks to the mesh, exactly as a one-rank
engine does. It starts one follower process per other rank, forked by multiprocessing's fork server (a process of
the leader's that imports torch once for all ranks; a fork of the leader itself would copy its threads' locks
half-held). Each builds its shard of the model and its pools (engine/rank.py) and then repeats what the leader
sends: every step's host inputs (runner.HostStep) with the pool writes the leader made since the last step (zeroed
or copied GDN slots), the CUDA graph capture, the stop, and a hand-off's exchange of one request's state with the
leader (engine/tp_handoff.py: its part of a held state gathered, its part of an arrived state scattered). Inside a
step, and in a hand-off, the ranks meet in collectives over the engine's group (parallel.TensorParallelGroup).
torch.distributed carries both: gloo on CPU, NCCL for the tensors on CUDA with a gloo group beside it for the
messages.

Under data-parallel attention (engine/data_parallel.py) each step message carries every rank's own inputs and
pool writes, and a hand-off moves one request's state between the leader and the one rank that holds it.

A follower that exits ends its leader's engine: the leader checks its followers before every step, and from
then on ends every request with the reason (the worker's health turns NOT_SERVING).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import signal
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import structlog
import torch

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.parallel import Shard, TensorParallelGroup

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = structlog.get_logger("deltamesh.tp")

# how long a rank waits for the others: to join, and in any one collective
TIMEOUT = timedelta(seconds=300)


def rank_device(device: str, rank: int) -> str:
    """Rank r of an engine on `device`: the same CPU, or the r-th GPU from the given one."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def join_group(
    config: EngineConfig, full: ModelConfig, rank: int, store: Any
) -> tuple[TensorParallelGroup, ProcessGroup | None]:
    """(the model's collectives, the gloo group the leader's messages travel on) of this rank; `store`: the
    leader's torch.distributed TCPStore, where the ranks meet."""
    import torch.distributed as dist

    from deltamesh.engine.data_parallel import DataParallelGroup

    cuda = config.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank_device(config.device, rank))
    size, data_parallel = config.num_ranks, config.data_parallel_size > 1
    dist.init_process_group("nccl" if cuda else "gloo", store=store, world_size=size, rank=rank, timeout=TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else dist.group.WORLD
    shard = Shard(size, rank, full, config.enable_expert_parallel, data_parallel)
    return (DataParallelGroup if data_parallel else TensorParallelGroup)(shard, dist.group.WORLD), control


class Followers:
    """The leader's side: starts ranks 1..N-1, sends them its steps, watches that they stay alive."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        import torch.distributed as dist

        # the store listens on a port of its own choosing before any follower starts: no port to race for
        store = dist.TCPStore("127.0.0.1", 0, config.num_ranks, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        starter = multiprocessing.get_context("forkserver")
        starter.set_forkserver_preload(["deltamesh.engine.tp_workers"])  # torch with it
        self.procs = [
            starter.Process(target=run_follower, args=(config, r, store.port), name=f"deltamesh-rank-{r}")
            for r in range(1, config.num_ranks)
        ]
        for proc in self.procs:
            proc.start()
        self._closing = False
        try:
            self.group, self._control = join_group(config, model_config, 0, store)
        except BaseException:
            self._kill()
            raise
        self.pool_ops: list[tuple] = []  # the leader's pool writes since its last step (cache.StatePool.mirror)
        # data parallel: each follower's own pool writes, made in the leader's bookkeeping copy of its pools
        self.rank_ops: list[list[tuple]] = [[] for _ in range(config.num_ranks)]
        log.info(
            "parallel ranks joined",
            ranks=config.num_ranks,
            data_parallel=config.data_parallel_size > 1,
            device=config.device,
        )

    def collect_rank_memory(self) -> dict[int, RankMemory]:
        """What each follower made readable of its pools (`follow`, with an exporter): rank -> RankMemory."""
        import torch.distributed as dist

        got: list = [None] * self.group.shard.size
        dist.gather_object(None, got, dst=0, group=self._control)
        return {rank: memory for rank, memory in enumerate(got) if rank}

    def send_step(self, step) -> None:
        ops, self.pool_ops[:] = list(self.pool_ops), []
        self._send(("step", step, ops))

    def send_data_parallel_step(self, steps: list, pending_count: int) -> None:
        """Every rank's own step inputs (data_parallel.run_rank), with its pool writes since its last step."""
        ops = [list(mine) for mine in self.rank_ops]
        for mine in self.rank_ops:
            mine.clear()
        self._send(("dp_step", steps, ops, pending_count))

    def send_point_to_point(self, direction: str, rank: int, pages: list[int], slot: int) -> None:
        """Data parallel: rank `rank` sends ("send") its state of a request to the leader next, or receives
        ("recv") one from it (data_parallel.follow_point_to_point)."""
        self._send(("p2p", direction, rank, pages, slot))

    def capture_decode_graphs(self, max_batch: int, max_context: int) -> None:
        self._send(("capture", max_batch, max_context))

    def send_gather(self, pages: list[int], slot: int) -> None:
        """The followers send their parts of this request's state to the leader next (tp_handoff.gather_parts)."""
        self._send(("gather", pages, slot))

    def send_scatter(self, pages: list[int], slot: int) -> None:
        """The followers take their parts of this request's state from the leader next (tp_handoff.scatter_parts)."""
        self._send(("scatter", pages, slot))

    def _send(self, message: tuple) -> None:
        import torch.distributed as dist

        if self.failure:
            raise RuntimeError(self.failure)
        dist.broadcast_object_list([message], src=0, group=self._control)

    @property
    def failure(self) -> str | None:
        """Why the engine cannot step any more (a follower exited), or None. Asked before every step and after
        a failed one (a collective with a dead rank fails at once on gloo; on NCCL it may wait for TIMEOUT)."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None and not self._closing:
                return f"tensor-parallel rank {rank} exited (code {proc.exitcode})"
        return None

    def failure_within(self, seconds: float) -> str | None:
        """`failure`, waiting up to `seconds` for it: a collective can fail on a closed connection a moment
        before the exited follower can be reaped."""
        deadline = time.monotonic() + seconds
        while not (reason := self.failure) and time.monotonic() < deadline:
            time.sleep(0.02)
        return reason

    def close(self) -> None:
        import torch.distributed as dist

        if self._closing:
            return
        failed = self.failure
        self._closing = True
        try:
            if not failed:
                dist.broadcast_object_list([("stop",)], src=0, group=self._control)
        except Exception:  # a follower already gone: nothing left to tell
            pass
        for proc in self.procs:
            proc.join(timeout=20)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        dist.destroy_process_group()

    def _kill(self) -> None:
        for proc in self.procs:
            proc.kill()


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """A follower's pools as its exporter made them readable: the exporter's bytes (for the transport's holder)
    and where each pool (kv, conv, recurrent) starts in the follower's process, and its size."""

    exported: bytes
    pools: list[tuple[int, int]]


def exports_rank_memory(config: EngineConfig) -> bool:
    """Whether the followers export their pools at start (and the leader collects them then)."""
    return config.rank_exporter is not None and config.num_ranks > 1


def export_rank_memory(config: EngineConfig, views: list[torch.Tensor]) -> RankMemory:
    import importlib

    assert config.rank_exporter is not None, "called only when exports_rank_memory(config)"
    module, _, function = config.rank_exporter.partition(":")
    exported = getattr(importlib.import_module(module), function)(views)
    return RankMemory(exported, [(v.data_ptr(), v.numel()) for v in views])


def follow(config: EngineConfig, rank: int, store_port: int) -> None:
    """A follower rank: build this rank's part of the engine, then repeat the leader's steps until it stops."""
    import torch.distributed as dist

    from deltamesh.engine.cache import pool_views
    from deltamesh.engine.data_parallel import DataParallelGroup, follow_point_to_point, run_rank
    from deltamesh.engine.gc_pauses import freeze_startup_heap
    from deltamesh.engine.rank import build_rank
    from deltamesh.engine.tp_handoff import gather_parts, rank_state, scatter_parts, store_rank_state

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    mc = ModelConfig.from_dir(config.model)
    store = dist.TCPStore("127.0.0.1", store_port, config.num_ranks, is_master=False, timeout=TIMEOUT)
    tp, control = join_group(config, mc, rank, store)
    device = torch.device(rank_device(config.device, rank))
    me = build_rank(config, mc, config.resolved_max_model_len(mc.max_position_embeddings), device, tp)
    if exports_rank_memory(config):
        memory = export_rank_memory(config, pool_views(me.kv_pool, me.state_pool))
        dist.gather_object(memory, None, dst=0, group=control)
    pools = {"slots": me.state_pool, "checkpoints": me.checkpoint_pool}
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        kind, *args = message[0]
        if kind == "stop":
            break
        if kind == "capture":  # the last of the leader's start-up: what is alive now lives as long as the rank
            me.runner.capture_decode_graphs(*args)
            freeze_startup_heap()
            continue
        if kind in ("gather", "scatter"):
            pages, slot = args
            mine = rank_state(me.kv_pool, me.state_pool, pages, slot)
            if kind == "gather":
                gather_parts(tp, mine)
            else:
                store_rank_state(me.kv_pool, me.state_pool, pages, slot, scatter_parts(tp, mine, None))
            continue
        if kind == "p2p":
            assert isinstance(tp, DataParallelGroup), "the leader sends p2p only to data-parallel ranks"
            follow_point_to_point(tp, me.kv_pool, me.state_pool, *args)
            continue
        if kind == "dp_step":
            steps, ops, pending_count = args
            _repeat(ops[rank], me, pools)
            assert isinstance(tp, DataParallelGroup), "the leader sends dp_step only to data-parallel ranks"
            run_rank(me.runner, tp, steps, rank, pending_count)
            continue
        step, ops = args
        _repeat(ops, me, pools)
        me.runner.run(step)
    dist.destroy_process_group()


def _repeat(ops: list[tuple], me, pools: dict) -> None:
    """The leader's writes to this rank's pools since the last step."""
    for op, name, *where in ops:
        if op == "zero":
            pools[name].zero(*where)
        elif op == "copy_page":
            me.kv_pool.copy_page(*where)
        else:
            dst, src_name, src = where
            pools[name].copy_slot(dst, pools[src_name], src)


def run_follower(config: EngineConfig, rank: int, store_port: int) -> None:
    """A follower process's start (the fork server's child): `follow` with the leader's EngineConfig."""
    # Ctrl-C reaches the whole process group: the leader stops its followers itself (a "stop" message), and a
    # leader that is gone ends them through their next collective
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    follow(config, rank, store_port)
