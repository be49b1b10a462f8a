"""bench/transfer.py's two processes: a holder (prefill-like: offers states under leases through the
transport's StateHolder) and a puller (decode-like: pulls them through its StatePuller into pools of its own),
driven by the parent over pipes, as the router carries leases and descriptors over gRPC in the mesh.

Each process has the engine's pools (engine.cache.KVPagePool + StatePool) sized from the model config alone, no
weights; a request's state is its KV page run and its GDN conv and recurrent state, allocated as the scheduler
does. Messages are tuples, the first item naming them; every answer the parent waits for says so too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import time
import zlib
from dataclasses import dataclass

from bench.transfer_floors import (
    close_floor_endpoints,
    floor_holder,
    floor_puller,
    floor_rma_loop,
    floor_rma_puller,
)
from bench.transfer_overlap import EngineLoop, Spans

PAGE_SIZE = 16


@dataclass
class Options:
    model_config: str
    dtype: str
    state_dtype: str
    max_tokens: int
    error_handling: bool
    timeout_s: float
    proto_info: bool
    device: str = "cpu"  # cuda: holder on GPU 0, puller on GPU 1 (UCX moves GPU memory, e.g. cuda_ipc/NVLink)
    in_flight: int = 1  # requests pulled at once (their pulls overlap)
    overlap_model: str | None = None  # run an engine loop of this model beside the transfers
    overlap_side: str = "decode"  # decode: a decode loop in the puller; prefill: a prefill loop in the holder
    overlap_batch: int = 8
    overlap_context: int = 1024  # decode: the batch's context; prefill: each request's prompt chunk per step
    overlap_idle_s: float = 3.0  # engine steps before the first pull: the undisturbed baseline
    spin_s: float = 0.02  # GPU pulls progress UCX on every loop turn for at most this long (UcxPuller spin_s)
    rotate: int = 1  # the puller's pulls land in this many places of its pools in turn (1: always the same pages)
    sequence: int = 1  # requests pulled one after another, back to back (each starts when the one before ends)
    gap_s: float = 0.0  # the GPUs and the link stay idle this long before each pull (each sequence)
    offers_first: int = 0  # turns whose states the holder prepares before its engine loop starts (0: each in turn)
    warm: bool = False  # before the first pull, the puller runs the transport's warm-up (StatePuller.warm)

    @property
    def offers_per_pull(self) -> int:
        """Leases offered for each of the puller's turns: pulled at once (--in-flight) or in a row (--sequence)."""
        return max(self.in_flight, self.sequence)

    def engine_loop(self, side: str) -> EngineLoop | None:
        """The engine loop beside the pulls, if it runs on `side` (decode: the puller, prefill: the holder)."""
        if not self.overlap_model or self.overlap_side != side:
            return None
        return EngineLoop(self.overlap_model, self.device, side, self.overlap_batch, self.overlap_context)


def pools(opts: Options, copies: int = 1, device: str | None = None):
    """The engine's pools for `copies` x opts.offers_per_pull requests of up to opts.max_tokens tokens."""
    import torch

    from deltamesh.engine.cache import KVPagePool, StatePool
    from deltamesh.engine.config import ModelConfig

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    mc = ModelConfig.from_dir(opts.model_config)
    dtype, state_dtype = dtypes[opts.dtype], dtypes[opts.state_dtype]
    where = torch.device(device or opts.device)
    requests = opts.offers_per_pull * copies
    kv = KVPagePool(
        requests * -(-opts.max_tokens // PAGE_SIZE),
        PAGE_SIZE,
        len(mc.full_layers),
        mc.num_key_value_heads,
        mc.head_dim,
        dtype,
        where,
    )
    st = StatePool(
        requests,
        len(mc.linear_layers),
        mc.conv_dim,
        mc.linear_conv_kernel_dim,
        mc.linear_num_value_heads,
        mc.linear_key_head_dim,
        mc.linear_value_head_dim,
        dtype,
        state_dtype,
        where,
    )
    return kv, st


def state_sizes(opts: Options):
    """tokens -> (KV bytes, GDN state bytes) of one request's state."""
    kv, st = pools(Options(**{**opts.__dict__, "in_flight": 1, "sequence": 1}), device="meta")
    return lambda n_tokens: (kv.pages_for(n_tokens) * kv.page_bytes, st.slot_bytes)


def _buffers(kv, st, pages, slot) -> list:
    """A request's state as a transport moves it: its KV page runs, then its GDN conv and recurrent state."""
    return [r.tensor for r in kv.regions(pages) + st.regions(slot)]


def _checksum(buffers) -> int:
    """Of the byte stream the buffers make up, whatever way it is split: CRC32 on the host; for GPU buffers a
    position-weighted sum computed on the device, because copying a GiB out for a CRC occupies the copy engine
    the decode loop's small result reads queue behind."""
    import torch

    buffers = list(buffers)
    if not buffers[0].is_cuda:
        crc = 0
        for b in buffers:
            crc = zlib.crc32(b.numpy(), crc)
        return crc
    from bench.gpu_common import host_list

    total, offset, chunk = torch.zeros((), dtype=torch.int64, device=buffers[0].device), 0, 1 << 24
    for b in buffers:
        for start in range(0, b.numel(), chunk):
            part = b[start : start + chunk]
            weights = torch.arange(offset, offset + part.numel(), device=b.device, dtype=torch.int64)
            total += (part.to(torch.int64) * (weights * 0x9E3779B97F4A7C1 + 1)).sum()  # int64 wraps around
            offset += part.numel()
    return host_list(total)  # waits with the GIL released


def _setup_process(opts: Options, gpu: int):
    """Before ucxx (and CUDA) is imported: one GPU per process, UCX's protocols on request. Returns the process's
    transport (loopback only)."""
    from deltamesh.transfer.ucx import UcxTransport

    if opts.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    transport = UcxTransport(None, opts.error_handling, opts.spin_s, cuda=opts.device == "cuda")
    if opts.proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    return transport


class _Side:
    """A process's message loop: `on_<name>` handles the parent's message `name` until "stop"."""

    def __init__(self, conn):
        self.conn = conn

    async def serve(self) -> None:
        while True:
            msg = await asyncio.to_thread(self.conn.recv)
            if msg[0] == "stop":
                return
            await getattr(self, "on_" + msg[0].replace("-", "_"))(*msg[1:])


class HolderSide(_Side):
    def __init__(self, conn, opts: Options, transport):
        from deltamesh.transfer import LeaseTable

        super().__init__(conn)
        self.opts = opts
        self.kv, self.st = pools(opts, copies=max(1, opts.offers_first))
        self.leases = LeaseTable()
        self.holder = transport.holder(self.leases)
        self.ended: dict[str, asyncio.Future] = {}
        self.preps: Spans = []  # when the benchmark seeded and summed an offer (GPU work beside the loop)

    async def run(self) -> None:
        await self.holder.start()
        self.engine_loop = self.opts.engine_loop("prefill")
        self.conn.send(("ready", self.holder.address))
        try:
            await self.serve()
        finally:
            await self.holder.stop()

    async def on_start_loop(self) -> None:  # after any offers prepared up front
        if self.engine_loop:
            self.engine_loop.start()

    async def on_report(self) -> None:
        self.conn.send(("overlap", self.engine_loop.stop() if self.engine_loop else None, self.preps))

    async def on_pools(self) -> None:
        """The whole pools and the lease words, as a prefill worker registers them."""
        from deltamesh.engine.cache import pool_views

        self.conn.send(("pools", self.holder.describe(pool_views(self.kv, self.st))))

    async def on_offer(self, lease_id: str, n_tokens: int, seed: int) -> None:
        import torch

        from deltamesh.transfer import LeaseKey

        kv, st, loop = self.kv, self.st, asyncio.get_running_loop()
        prep_started = time.perf_counter()
        pages, slot = kv.alloc(kv.pages_for(n_tokens)), st.alloc()
        kv_regions, st_regions = kv.regions(pages), st.regions(slot)
        tensors = [r.tensor for r in kv_regions + st_regions]
        gen = torch.Generator(device=self.opts.device).manual_seed(seed)
        for t in tensors:
            t.random_(0, 256, generator=gen)
        fut = self.ended[lease_id] = loop.create_future()

        def on_end(reason):
            kv.free(pages)
            st.free(slot)
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(reason))

        lease = self.leases.offer(lease_id, tensors, self.opts.timeout_s, on_end)
        checksum = _checksum(tensors)
        self.preps.append((prep_started, time.perf_counter()))
        sizes = [t.numel() for t in tensors]
        self.conn.send(
            (
                "offered",
                LeaseKey(lease_id, lease.token),
                self.holder.offer(lease),
                sizes,
                checksum,
                sum(r.nbytes for r in kv_regions),
                sum(r.nbytes for r in st_regions),
            )
        )

    async def on_floor(self, kind: str, n_tokens: int, reps: int, tag: int, puller_address: bytes) -> None:
        pages, slot = self.kv.alloc(self.kv.pages_for(n_tokens)), self.st.alloc()
        try:
            buffers = _buffers(self.kv, self.st, pages, slot)
            if kind == "tag":
                self.conn.send(("floor-ready", None))
                floor_holder(puller_address, buffers, reps, tag, self.opts.error_handling)
            else:  # RMA floors: the puller reads on its own; keep the buffers until it is done
                self.conn.send(("floor-ready", self.holder.regions(buffers)))
                if (await asyncio.to_thread(self.conn.recv))[0] != "floor-done":
                    raise RuntimeError("RMA floor: expected the puller's end")
        finally:
            self.kv.free(pages)
            self.st.free(slot)

    async def on_finish(self, lease_id: str) -> None:
        """How the lease ended, and when its done notice arrived."""
        try:
            reason = await asyncio.wait_for(self.ended.pop(lease_id), self.opts.timeout_s)
        except TimeoutError:
            self.leases.release(lease_id)
            reason = "timeout"
        times = next((t for t in self.holder.timeline if t["lease_id"] == lease_id), None)
        self.conn.send(("finished", reason, times))


class PullerSide(_Side):
    def __init__(self, conn, opts: Options, transport):
        import torch

        super().__init__(conn)
        self.opts = opts
        self.kv, self.st = pools(opts, copies=opts.rotate)
        self.puller = transport.puller()
        self.turns = 0
        # The bench's own GPU work (zeroing the targets, their checksum) runs on a side stream, so the decode loop's
        # kernels (on the default stream) never queue behind it and its step times stay clean.
        self.aux = torch.cuda.Stream() if opts.device == "cuda" else None
        self.pulls: Spans = []
        self.checks: Spans = []  # when the benchmark checked the pulled bytes (after each pull)
        self.warm_ups: Spans = []

    def _on_aux(self):
        import torch

        return torch.cuda.stream(self.aux) if self.aux else contextlib.nullcontext()

    async def run(self) -> None:
        from deltamesh.transfer.ucx import loop_worker

        await self.puller.start()
        self.engine_loop = self.opts.engine_loop("decode")
        self.conn.send(("ready", loop_worker.get().address))
        if self.engine_loop:
            self.engine_loop.start()
        try:
            await self.serve()
        finally:
            await self.puller.close()
            close_floor_endpoints()

    async def on_floor(self, kind, n_tokens, reps, tag, holder_address, regions, pause) -> None:
        kv, st, opts = self.kv, self.st, self.opts
        pages, slot = kv.alloc(kv.pages_for(n_tokens)), st.alloc()
        try:
            buffers = _buffers(kv, st, pages, slot)
            if kind == "tag":
                secs = floor_puller(holder_address, buffers, reps, tag, opts.error_handling)
            elif kind == "rma":
                secs = floor_rma_puller(holder_address, regions, buffers, reps, opts.error_handling, pause)
            else:
                secs = await floor_rma_loop(holder_address, regions, buffers, reps, opts.error_handling, opts.spin_s)
            self.conn.send(("floored", secs, len(buffers)))
        finally:
            kv.free(pages)
            st.free(slot)

    async def on_report(self) -> None:
        """The decode loop's steps (if it runs here) and when the pulls ran."""
        steps = self.engine_loop.stop() if self.engine_loop else None
        self.conn.send(("overlap", steps, self.pulls, self.checks, self.warm_ups))

    async def on_warm(self, holder) -> None:
        """As deltamesh/services/decode/peers.py does when a prefill worker joins."""
        import torch

        assert self.puller.announce(holder)  # its leases are checked against it, as a decode worker's are
        t0 = time.perf_counter()
        await self.puller.warm(holder, torch.device(self.opts.device), self.opts.timeout_s)
        self.warm_ups.append((t0, time.perf_counter()))
        self.conn.send(("warmed", self.warm_ups[-1][1] - t0))

    def _reserve(self, n_tokens: int, count: int) -> list[tuple[list[int], int]]:
        """Pages and a slot for each of `count` requests, as Reservations.reserve takes them; with --rotate, after
        the places of the turns before (held for a moment), so that they change from turn to turn."""
        kv, st = self.kv, self.st
        spacer = [
            (kv.alloc(kv.pages_for(n_tokens)), st.alloc(zeroed=False))
            for _ in range(self.turns % self.opts.rotate * count)
        ]
        held = [(kv.alloc(kv.pages_for(n_tokens)), st.alloc(zeroed=False)) for _ in range(count)]
        for pages, slot in spacer:
            kv.free(pages)
            st.free(slot)
        self.turns += 1
        return held

    async def on_pull(self, n_tokens: int, offers: list[tuple]) -> None:
        """Pull each offer (lease key, descriptor, region sizes, checksum) into places of this process's pools: at
        once, or one after another (--sequence); then check every byte."""
        held = self._reserve(n_tokens, len(offers))
        try:
            targets = [_buffers(self.kv, self.st, pages, slot) for pages, slot in held]
            with self._on_aux():
                for b in (b for buffers in targets for b in buffers):
                    b.zero_()
            if self.aux:  # UCX writes from its own stream: the zeroing must be done before the pull starts
                self.aux.synchronize()
            if self.opts.gap_s:
                await asyncio.sleep(self.opts.gap_s)
            self.conn.send(("pulled", await self._pull(offers, targets)))
        finally:
            for pages, slot in held:
                self.kv.free(pages)
                self.st.free(slot)

    async def _pull(self, offers: list[tuple], targets: list[list]) -> dict:
        from deltamesh.transfer import TransferError

        opts = self.opts
        pulls = [
            self.puller.pull(self.puller.source(descriptor, key, sizes), buffers, opts.timeout_s)
            for (key, descriptor, sizes, _), buffers in zip(offers, targets)
        ]
        t0 = time.perf_counter()
        try:
            stats = [await pull for pull in pulls] if opts.sequence > 1 else await asyncio.gather(*pulls)
        except TransferError as e:
            for pull in pulls:  # those of the sequence not started
                pull.close()
            return {"error": str(e)}
        wall = time.perf_counter() - t0
        self.pulls.append((t0, t0 + wall))
        with self._on_aux():
            ok = all(_checksum(buffers) == offer[-1] for offer, buffers in zip(offers, targets))
        self.checks.append((t0 + wall, time.perf_counter()))
        return {
            "nbytes": sum(x.nbytes for x in stats),
            "buffers": stats[0].buffers,
            "seconds": stats[0].seconds if len(stats) == 1 else wall,
            "wall_seconds": wall,
            "pull_seconds": [x.seconds for x in stats],
            "marks": [x.marks for x in stats],
            "puller_regions": len(targets[0]),
            "crc_ok": ok,
        }


def _side_main(side_cls, name: str, gpu: int, conn, opts: Options) -> None:
    transport = _setup_process(opts, gpu)

    async def main() -> None:
        await side_cls(conn, opts, transport).run()

    try:
        asyncio.run(main())
    except Exception as e:  # tell the parent instead of leaving it waiting
        conn.send(("error", f"{name}: {e!r}"))
        raise


def holder_main(conn, opts: Options) -> None:
    _side_main(HolderSide, "holder", 0, conn, opts)


def puller_main(conn, opts: Options) -> None:
    _side_main(PullerSide, "puller", 1, conn, opts)


def expect(conn, kind: str, timeout_s: float):
    """The items of the child's next message, which must be `kind`."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {kind!r} from a child within {timeout_s:.0f}s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    if msg[0] != kind:
        raise RuntimeError(f"expected {kind!r}, got {msg!r}")
    return msg[1:]


@contextlib.contextmanager
def processes(opts: Options):
    """A holder and a puller process; yields the parent's ends of their pipes and stops them on exit."""
    ctx = mp.get_context("spawn")
    h_conn, h_child = ctx.Pipe()
    p_conn, p_child = ctx.Pipe()
    holder = ctx.Process(target=holder_main, args=(h_child, opts), name="bench-holder", daemon=True)
    puller = ctx.Process(target=puller_main, args=(p_child, opts), name="bench-puller", daemon=True)
    holder.start()
    puller.start()
    try:
        yield h_conn, p_conn
    finally:
        for conn in (h_conn, p_conn):
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in (holder, puller):
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
