"""Side-channel transfer benchmark (CPU): how fast one request's hybrid state (full-attention KV pages + GDN
conv and recurrent state) moves from a prefill-like holder process to a decode-like puller process over
the UCX side channel (transfer.StateServer / transfer.StatePuller), on loopback.

    .venv/bin/python bench/transfer.py                                  # 9B shape, 128 .. 8k tokens, both modes
    .venv/bin/python bench/transfer.py --quick                          # smoke run
    .venv/bin/python bench/transfer.py --model-config bench/configs/qwen3.5-35b-a3b --lengths 1024,4096

Setup, per UCX mode (error handling on: UCX must be able to report a dead peer, which on a CPU host
means TCP over `lo`; off: UCX may use shared memory / CMA between the two processes):
- two fresh processes (multiprocessing, spawn), each calling transfer.configure_ucx("127.0.0.1") before
  ucxx is touched. Each allocates engine pools (engine.cache.KVPagePool + StatePool) from the model config
  alone, no weights: page size 16, KV/conv dtype --dtype, recurrent state --state-dtype.
- holder: allocates pages + a slot for an L-token request the way the scheduler does (best-fit run),
  fills them with seeded random bytes, checksums them (CRC32; on GPUs a sum on the device) and offers a lease (transfer.LeaseTable) to
  its StateServer. The worker address, lease id/token/word and regions (sizes, addresses, remote keys) go to the puller through the
  parent (multiprocessing Pipes), as the router carries them over gRPC in the mesh.
- puller: reserves pages + a slot in its own pools (zeroed), pulls (StatePuller.pull) and checks the
  checksum of what arrived before anything is reported; the holder confirms the lease ended as "pulled".
Each length runs --reps + 1 pulls; the first is left out of the medians and reported apart (the first pull from a
peer pays UCX's set-up, which --warm does before it, as a decode worker does). Seconds are StatePuller's own
(called -> every segment received and the lease word checked, endpoint reuse included as in a running worker). The baseline row
is a single-threaded torch copy of the same number of bytes within one process (with --device cuda: a raw
GPU 0 -> GPU 1 copy, back to back and after each pause of --gap-ms or 20 ms, those also timed on the host). Options: --floor adds UCX's own floors, by tag messages
(floor_holder) and by the bare RMA reads a pull posts, spinning (floor_rma_puller; back to back and each after an
idle pause: each --gap-ms, or 20 ms) and through the event loop (floor_rma_loop); --in-flight N pulls
N requests at once, --sequence N pulls N in a row (back to back, as the raw copy's first row), --gap-ms G leaves the
GPUs idle G ms before each pull (as its second row); --overlap-model DIR runs a real engine loop on a thread, as a worker does, and reports its step
times before the first pull vs during pulls: a decode loop in the puller, or with --overlap-side prefill a
prefill loop in the holder (whose event loop takes the notices, and over TCP serves the reads); --offers-first
has the holder prepare every state before that loop starts, so none of the benchmark's own GPU work runs beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    busy_warning,
    command_line,
    human_bytes,
    machine_info,
    mean,
    median,
    rel,
    table,
    utc_now,
    write_json,
)

ROOT = Path(__file__).resolve().parents[1]
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
    spin_s: float = 0.02  # StatePuller(spin_s=...): GPU pulls progress UCX on every loop turn for at most this long
    rotate: int = 1  # the puller's pulls land in this many places of its pools in turn (1: always the same pages)
    sequence: int = 1  # requests pulled one after another, back to back (each starts when the one before ends)
    gap_s: float = 0.0  # the GPUs and the link stay idle this long before each pull (each sequence)
    offers_first: int = 0  # turns whose states the holder prepares before its engine loop starts (0: each in turn)
    warm: bool = False  # before the first pull, the puller runs the side-channel warm-up (StatePuller.warm)


# ---------------------------------------------------------------------------------------------------
# Both sides
# ---------------------------------------------------------------------------------------------------
def _setup_process(opts: Options, gpu: int = 0):
    """Before ucxx (and CUDA) is imported: loopback only, one GPU per process, UCX's protocols on request. Returns
    the process's transport."""
    from transfer.ucx import UcxTransport

    if opts.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    transport = UcxTransport("127.0.0.1", opts.error_handling, opts.spin_s)
    if opts.proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    return transport


def _pools(opts: Options, copies: int = 1):
    """The engine's pools for `copies` x opts.in_flight requests of up to opts.max_tokens tokens, sized from the
    config."""
    import torch

    from engine.cache import KVPagePool, StatePool
    from engine.config import ModelConfig

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    mc = ModelConfig.from_dir(opts.model_config)
    dtype, state_dtype = dtypes[opts.dtype], dtypes[opts.state_dtype]
    cpu = torch.device(opts.device)
    requests = _offers_per_pull(opts) * copies
    kv = KVPagePool(
        requests * -(-opts.max_tokens // PAGE_SIZE), PAGE_SIZE, len(mc.full_layers), mc.num_key_value_heads, mc.head_dim,
        dtype, cpu,
    )  # fmt: skip
    st = StatePool(
        requests, len(mc.linear_layers), mc.conv_dim, mc.linear_conv_kernel_dim, mc.linear_num_value_heads,
        mc.linear_key_head_dim, mc.linear_value_head_dim, dtype, state_dtype, cpu,
    )  # fmt: skip
    return kv, st


def _offers_per_pull(opts: Options) -> int:
    """Leases offered for each of the puller's turns: pulled at once (--in-flight) or in a row (--sequence)."""
    return max(opts.in_flight, opts.sequence)


def _buffers(kv, st, pages, slot) -> list:
    """A request's state as the side channel moves it: its KV page runs, then its GDN conv and recurrent state."""
    return [r.tensor for r in kv.regions(pages) + st.regions(slot)]


def _checksum(buffers) -> int:
    """Of the byte stream the buffers make up, whatever way it is split: CRC32 on the host; for GPU buffers a
    position-weighted sum computed on the device, because copying a GiB out for a CRC occupies the copy engine
    the decode loop's small result reads queue behind (that stalled its steps by up to 0.9 s)."""
    import torch

    buffers = list(buffers)
    if not buffers[0].is_cuda:
        crc = 0
        for b in buffers:
            crc = zlib.crc32(b.numpy(), crc)
        return crc
    from engine.sampling import host_list

    total, offset, chunk = torch.zeros((), dtype=torch.int64, device=buffers[0].device), 0, 1 << 24
    for b in buffers:
        for start in range(0, b.numel(), chunk):
            part = b[start : start + chunk]
            weights = torch.arange(offset, offset + part.numel(), device=b.device, dtype=torch.int64)
            total += (part.to(torch.int64) * (weights * 0x9E3779B97F4A7C1 + 1)).sum()  # int64 wraps around
            offset += part.numel()
    return host_list(total)  # waits with the GIL released


async def _recv(conn):
    return await asyncio.to_thread(conn.recv)


# ---------------------------------------------------------------------------------------------------
# Holder (prefill side)
# ---------------------------------------------------------------------------------------------------
def holder_main(conn, opts: Options) -> None:
    transport = _setup_process(opts)
    try:
        asyncio.run(_holder(conn, opts, transport))
    except Exception as e:  # tell the parent instead of leaving it waiting
        conn.send(("error", f"holder: {e!r}"))
        raise


async def _holder(conn, opts: Options, transport) -> None:
    import torch

    from engine.cache import pool_views
    from transfer import LeaseKey, LeaseTable

    kv, st = _pools(opts, copies=max(1, opts.offers_first))
    leases = LeaseTable()
    server = transport.holder(leases)
    await server.start()
    loop = asyncio.get_running_loop()
    ended: dict[str, asyncio.Future] = {}
    preps: list[tuple[float, float]] = []  # when the benchmark seeded and summed an offer (GPU work beside the loop)
    prefill_loop = EngineLoop(opts) if opts.overlap_model and opts.overlap_side == "prefill" else None
    conn.send(("ready", server.address))
    try:
        while True:
            msg = await _recv(conn)
            if msg[0] == "stop":
                break
            if msg[0] == "start-loop" and prefill_loop:  # after any offers prepared up front
                prefill_loop.start()
            if msg[0] == "report":
                conn.send(("overlap", prefill_loop.stop() if prefill_loop else None, preps))
            if msg[0] == "pools":  # the whole pools and the lease words, as a prefill worker registers them
                conn.send(("pools", server.describe(pool_views(kv, st))))
            if msg[0] == "offer":
                _, lease_id, n_tokens, seed = msg
                prep_started = time.perf_counter()
                pages, slot = kv.alloc(kv.pages_for(n_tokens)), st.alloc()
                kv_regions, st_regions = kv.regions(pages), st.regions(slot)
                tensors = [r.tensor for r in kv_regions + st_regions]
                gen = torch.Generator(device=opts.device).manual_seed(seed)
                for t in tensors:
                    t.random_(0, 256, generator=gen)
                fut = loop.create_future()
                ended[lease_id] = fut

                def on_end(reason, pages=pages, slot=slot, fut=fut):
                    kv.free(pages)
                    st.free(slot)
                    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(reason))

                lease = leases.offer(lease_id, tensors, opts.timeout_s, on_end)
                checksum = _checksum(tensors)
                preps.append((prep_started, time.perf_counter()))
                conn.send(("offered", LeaseKey(lease_id, lease.token), server.offer(lease), [t.numel() for t in tensors],
                           checksum, sum(r.nbytes for r in kv_regions), sum(r.nbytes for r in st_regions)))  # fmt: skip
            elif msg[0] == "floor":
                _, kind, n_tokens, reps, tag, puller_address = msg
                pages, slot = kv.alloc(kv.pages_for(n_tokens)), st.alloc()
                try:
                    buffers = _buffers(kv, st, pages, slot)
                    if kind == "tag":
                        conn.send(("floor-ready", None))
                        floor_holder(puller_address, buffers, reps, tag, opts.error_handling)
                    else:  # RMA floors: the puller reads on its own; keep the buffers until it is done
                        conn.send(("floor-ready", server.regions(buffers)))
                        if (await _recv(conn))[0] != "floor-done":
                            raise RuntimeError("RMA floor: expected the puller's end")
                finally:
                    kv.free(pages)
                    st.free(slot)
            elif msg[0] == "finish":
                lease_id = msg[1]
                try:
                    reason = await asyncio.wait_for(ended.pop(lease_id), opts.timeout_s)
                except asyncio.TimeoutError:
                    leases.release(lease_id)
                    reason = "timeout"
                times = next((t for t in server.timeline if t["lease_id"] == lease_id), None)
                conn.send(("finished", reason, times))
    finally:
        await server.stop()


# ---------------------------------------------------------------------------------------------------
# Puller (decode side)
# ---------------------------------------------------------------------------------------------------
def puller_main(conn, opts: Options) -> None:
    transport = _setup_process(opts, gpu=1)
    try:
        asyncio.run(_puller(conn, opts, transport))
    except Exception as e:
        conn.send(("error", f"puller: {e!r}"))
        raise


class EngineLoop:
    """A real engine loop on its own thread, as a worker runs one beside its event loop, stepped back to back:
    `decode` (puller side): `batch` requests of `context` tokens, one token each per step; `prefill` (holder
    side): `batch` requests prefilling a `context`-token chunk each per step. (start, end) of each step,
    perf_counter."""

    def __init__(self, opts: Options):
        from bench.common import decode_items, prefill_items
        from engine import EngineConfig
        from engine.core import EngineCore

        ctx, batch = opts.overlap_context, opts.overlap_batch
        weights = "auto" if any(Path(opts.overlap_model).glob("*.safetensors")) else "dummy"
        self.core = EngineCore(EngineConfig(
            model=opts.overlap_model, load_format=weights, device=opts.device, max_num_seqs=batch,
            num_kv_pages=batch * -(-(ctx + 64) // 16) + 64, max_model_len=ctx + 64,
            max_num_batched_tokens=max(1024, ctx * (batch if opts.overlap_side == "prefill" else 1)),
        ))  # fmt: skip
        make_items = prefill_items if opts.overlap_side == "prefill" else decode_items
        self.items = make_items(self.core, batch, ctx)
        self.steps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{opts.overlap_side}-loop", daemon=True)

    def _run(self) -> None:
        from engine.sampling import host_list

        while not self._stop.is_set():
            t0 = time.perf_counter()
            host_list(self.core.runner.execute(self.items).argmax(-1))  # the engine's own wait for the GPU
            self.steps.append((t0, time.perf_counter()))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.steps


Spans = list[tuple[float, float]]  # (start, end) perf_counter() pairs


def overlap_summary(steps: Spans, pulls: Spans, checks: Spans = (), warm_ups: Spans = ()) -> dict:
    """Engine step times before the first pull or warm-up that overlap none of the benchmark's own GPU work (idle) vs
    steps that overlapped a pull; and, apart, the steps that overlapped a pull but none of `checks` (the
    benchmark's own GPU work beside the loop: on the decode side its check of the pulled bytes, right after
    each pull; on the prefill side its seeding and summing of each offered state) vs those that overlapped
    one; and the longest step that overlapped each side-channel warm-up."""

    def stats(xs: list[float]) -> dict:
        xs = sorted(x * 1e3 for x in xs)
        pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None  # noqa: E731
        return {"steps": len(xs), "median_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": xs[-1] if xs else None}

    def overlaps(start: float, end: float, spans) -> bool:
        return any(start < s1 and end > s0 for s0, s1 in spans)

    first = min(start for start, _ in [*pulls, *warm_ups])
    idle = [end - start for start, end in steps if end <= first and not overlaps(start, end, checks)]
    overlapping = [[end - start for start, end in steps if overlaps(start, end, [pull])] for pull in pulls]
    during = [end - start for start, end in steps if overlaps(start, end, pulls)]
    pull_only = [end - start for start, end in steps if overlaps(start, end, pulls) and not overlaps(start, end, checks)]
    checking = [end - start for start, end in steps if overlaps(start, end, checks)]
    return {"idle": stats(idle), "during_pulls": stats(during), "during_pulls_not_checks": stats(pull_only),
            "during_checks": stats(checking), "pulls": len(pulls),
            "max_step_ms_per_pull": [round(max(x) * 1e3, 3) if x else None for x in overlapping],
            "pull_ms": [round((p1 - p0) * 1e3, 3) for p0, p1 in pulls],
            "warm_up_ms": [round((w1 - w0) * 1e3, 3) for w0, w1 in warm_ups],
            "max_step_ms_per_warm_up": [round(max((e - s for s, e in steps if overlaps(s, e, [w])), default=0) * 1e3, 3)
                                        for w in warm_ups]}  # fmt: skip


async def _puller(conn, opts: Options, transport) -> None:
    import torch

    from transfer import TransferError
    from transfer.ucx import loop_worker

    kv, st = _pools(opts, copies=opts.rotate)
    pulled = 0
    puller = transport.puller()
    await puller.start()
    decode_loop = EngineLoop(opts) if opts.overlap_model and opts.overlap_side == "decode" else None
    # The bench's own GPU work (zeroing the targets, their checksum) runs on a side stream, so
    # the decode loop's kernels (on the default stream) never queue behind it and its step times stay clean.
    aux = torch.cuda.Stream() if opts.device == "cuda" else None
    on_aux = (lambda: torch.cuda.stream(aux)) if aux else contextlib.nullcontext
    pulls: list[tuple[float, float]] = []
    checks: list[tuple[float, float]] = []  # when the benchmark checked the pulled bytes (after each pull)
    warm_ups: list[tuple[float, float]] = []
    conn.send(("ready", loop_worker.get().address))
    if decode_loop:
        decode_loop.start()
    try:
        while True:
            msg = await _recv(conn)
            if msg[0] == "stop":
                break
            if msg[0] == "floor":
                _, kind, n_tokens, reps, tag, holder_address, regions, pause = msg
                pages, slot = kv.alloc(kv.pages_for(n_tokens)), st.alloc()
                try:
                    buffers = _buffers(kv, st, pages, slot)
                    if kind == "tag":
                        secs = floor_puller(holder_address, buffers, reps, tag, opts.error_handling)
                    elif kind == "rma":
                        secs = floor_rma_puller(holder_address, regions, buffers, reps, opts.error_handling, pause)
                    else:
                        secs = await floor_rma_loop(holder_address, regions, buffers, reps, opts)
                    conn.send(("floored", secs, len(buffers)))
                finally:
                    kv.free(pages)
                    st.free(slot)
                continue
            if msg[0] == "report":  # the decode loop's steps (if it runs here) and when the pulls ran
                conn.send(("overlap", decode_loop.stop() if decode_loop else None, pulls, checks, warm_ups))
                continue
            if msg[0] == "warm":  # as services/decode/peers.py does when a prefill worker joins
                _, holder = msg
                t0 = time.perf_counter()
                await puller.warm(holder, torch.device(opts.device), opts.timeout_s)
                warm_ups.append((t0, time.perf_counter()))
                conn.send(("warmed", warm_ups[-1][1] - t0))
                continue
            _, n_tokens, offers = msg  # offers: [(lease key, transport descriptor, region sizes, checksum)]
            # --rotate: hold the places before this pull's for a moment, so that its pages and slots come after them
            spacer = [(kv.alloc(kv.pages_for(n_tokens)), st.alloc(zeroed=False))
                      for _ in range(pulled % opts.rotate * len(offers))]  # fmt: skip
            held = [(kv.alloc(kv.pages_for(n_tokens)), st.alloc(zeroed=False)) for _ in offers]  # as EngineCore.reserve
            for pages, slot in spacer:
                kv.free(pages)
                st.free(slot)
            pulled += 1
            try:
                targets = [_buffers(kv, st, pages, slot) for pages, slot in held]
                with on_aux():
                    for b in (b for buffers in targets for b in buffers):
                        b.zero_()
                if aux:  # UCX writes from its own stream: the zeroing must be done before the pull starts
                    aux.synchronize()
                if opts.gap_s:
                    await asyncio.sleep(opts.gap_s)
                pulls_of = [puller.pull(puller.source(descriptor, key, sizes), buffers, opts.timeout_s)
                            for (key, descriptor, sizes, _), buffers in zip(offers, targets)]  # fmt: skip
                t0 = time.perf_counter()
                try:
                    if opts.sequence > 1:
                        stats = [await pull for pull in pulls_of]
                    else:
                        stats = await asyncio.gather(*pulls_of)
                except TransferError as e:
                    for pull in pulls_of:  # those of the sequence not started
                        pull.close()
                    conn.send(("pulled", {"error": str(e)}))
                    continue
                wall = time.perf_counter() - t0
                pulls.append((t0, t0 + wall))
                with on_aux():
                    ok = all(_checksum(buffers) == offer[-1] for offer, buffers in zip(offers, targets))
                checks.append((t0 + wall, time.perf_counter()))
                conn.send(("pulled", {"nbytes": sum(x.nbytes for x in stats), "buffers": stats[0].buffers,
                                      "seconds": stats[0].seconds if len(stats) == 1 else wall, "wall_seconds": wall,
                                      "pull_seconds": [x.seconds for x in stats], "marks": [x.marks for x in stats],
                                      "puller_regions": len(targets[0]), "crc_ok": ok}))  # fmt: skip
            finally:
                for pages, slot in held:
                    kv.free(pages)
                    st.free(slot)
    finally:
        await puller.close()
        for ep in _RMA_FLOOR_EPS.values():  # while CUDA is up: left to the exit, UCX's clean-up found it gone
            ep.close()
        _RMA_FLOOR_EPS.clear()


# ---------------------------------------------------------------------------------------------------
# Floors: the same buffers moved by bare tag messages or bare RMA reads, spinning on UCX progress
# ---------------------------------------------------------------------------------------------------
# No lease, no protocol, no waiting on the event loop: what UCX itself needs to move a request's state once the
# puller has asked (tag: a small "go" message, then the rendezvous of every buffer; RMA: the reads alone). Their
# distance to a pull is what the side channel's own code costs; their distance to the raw copy is UCX's.
DEFAULT_PAUSE_S = 0.02  # the "after idle" rows of the raw copy and the RMA floor, when --gap-ms names no pause


def _ucx_buffer(t):
    """What ucxx's Array takes: numpy for host memory, the tensor itself (CUDA array interface) on a GPU."""
    return t if t.is_cuda else t.numpy()


def _spin(worker, request) -> None:
    while not request.completed:
        worker.progress()
    request.check_error()


def _floor_tools(peer_address: bytes, error_handling: bool):
    from ucxx._lib.arr import Array
    from ucxx._lib.libucxx import UCXXTag

    from transfer.ucx import loop_worker

    ucx = loop_worker.get()
    return ucx.worker, ucx.endpoint(peer_address, error_handling), Array, UCXXTag


def floor_holder(puller_address: bytes, buffers, reps: int, tag: int, error_handling: bool) -> None:
    import numpy as np

    worker, ep, Array, UCXXTag = _floor_tools(puller_address, error_handling)
    go = np.zeros(8, dtype=np.uint8)
    try:
        for _ in range(reps + 1):
            _spin(worker, worker.tag_recv(Array(go), UCXXTag(tag)))
            for request in [ep.tag_send(Array(_ucx_buffer(b)), UCXXTag(tag + 1 + i)) for i, b in enumerate(buffers)]:
                _spin(worker, request)
    finally:
        ep.close()


def floor_puller(holder_address: bytes, buffers, reps: int, tag: int, error_handling: bool) -> list[float]:
    import numpy as np

    worker, ep, Array, UCXXTag = _floor_tools(holder_address, error_handling)
    go = np.ones(8, dtype=np.uint8)
    secs = []
    try:
        for _ in range(reps + 1):
            receives = [worker.tag_recv(Array(_ucx_buffer(b)), UCXXTag(tag + 1 + i)) for i, b in enumerate(buffers)]
            t0 = time.perf_counter()
            asked = ep.tag_send(Array(go), UCXXTag(tag))
            for request in receives:
                _spin(worker, request)
            secs.append(time.perf_counter() - t0)
            _spin(worker, asked)
    finally:
        ep.close()
    return secs[1:]  # the first is the warm-up


@contextlib.contextmanager
def _rma_floor(holder_address: bytes, regions, buffers, error_handling: bool):
    """What both RMA floors read with: the worker, one endpoint per holder (kept open, as a puller keeps its
    own), the holder's keys unpacked for it (destroyed afterwards) and the plan of segments."""
    from transfer.ucx import loop_worker, rma
    from transfer import segments

    ucx = loop_worker.get()
    if holder_address not in _RMA_FLOOR_EPS:
        _RMA_FLOOR_EPS[holder_address] = ucx.endpoint(holder_address, error_handling)
    ep = _RMA_FLOOR_EPS[holder_address]
    keys = [rma.RemoteKey(ep.handle, r.rkey) for r in regions]
    try:
        yield ucx, ep, keys, segments([r.nbytes for r in regions], [b.numel() for b in buffers])
    finally:
        for key in keys:
            key.close()


def floor_rma_puller(holder_address: bytes, regions, buffers, reps: int, error_handling: bool,
                     pause_s: float = 0.0) -> list[float]:  # fmt: skip
    """The RMA floor: the same reads a pull posts (one per segment, keys unpacked once), spinning on UCX progress
    until all are done; no lease check, no event loop. Its distance to a pull is the side channel's own cost.
    `pause_s`: the process, GPUs and link idle this long before each rep (what a pull after a pause starts from)."""
    from transfer.ucx import rma

    memory = rma.memory_type(buffers[0].is_cuda)
    secs = []
    with _rma_floor(holder_address, regions, buffers, error_handling) as (ucx, ep, keys, plan):
        for _ in range(reps + 1):
            time.sleep(pause_s)
            t0 = time.perf_counter()
            reads = [rma.GetRequest(ep.handle, buffers[j].data_ptr() + dst_off, n, regions[i].address + src_off,
                                    keys[i], memory) for i, src_off, j, dst_off, n in plan]  # fmt: skip
            for read in reads:
                _spin(ucx.worker, read)
            secs.append(time.perf_counter() - t0)
    return secs[1:]  # the first is the warm-up


async def floor_rma_loop(holder_address: bytes, regions, buffers, reps: int, opts: Options) -> list[float]:
    """The same reads as floor_rma_puller, posted and awaited through the event loop as a pull does (with its
    spin setting), still without the lease check: its distance to the RMA floor is the event loop's cost, its
    distance to a pull the check's."""
    spin_s = opts.spin_s if buffers[0].is_cuda else 0.0
    secs = []
    with _rma_floor(holder_address, regions, buffers, opts.error_handling) as (ucx, ep, keys, plan):
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            await asyncio.gather(*(ucx.get(ep, buffers[j][dst_off : dst_off + n], regions[i].address + src_off,
                                           keys[i], spin_s=spin_s) for i, src_off, j, dst_off, n in plan))  # fmt: skip
            secs.append(time.perf_counter() - t0)
    return secs[1:]  # the first is the warm-up


_RMA_FLOOR_EPS: dict[bytes, object] = {}


FLOORS = {"tag": "floor: bare tag messages, spinning on UCX progress",
          "rma": "floor: bare RMA reads, spinning on UCX progress",
          "loop": "floor: bare RMA reads through the event loop"}


def after_idle(mode: str, pause_s: float) -> str:
    """A row's mode, naming the idle pause before each of its reps (if any)."""
    return f"{mode}, each after {pause_s * 1e3:g} ms idle" if pause_s else mode


def run_floor(opts: Options, lengths: list[int], reps: int, pauses: list[float]) -> list[dict]:
    """Rows per length: the state's buffers moved by bare tag messages (see floor_holder) and by bare RMA
    reads (floor_rma_puller: back to back, and after each of `pauses`; floor_rma_loop)."""
    rows = []
    kv, st = _pools(Options(**{**asdict(opts), "device": "cpu"}))  # sizes only
    with _processes(opts) as (h_conn, p_conn):
        (holder_address,) = _expect(h_conn, "ready", 120)
        (puller_address,) = _expect(p_conn, "ready", 300)
        # every tag floor first: with error handling on, a tag floor run after an RMA floor to the same peer saw
        # its requests cancelled (not investigated further)
        kinds = [("tag", 0.0), ("rma", 0.0), *(("rma", pause) for pause in pauses), ("loop", 0.0)]
        for (kind, pause), (k, n_tokens) in ((kp, kn) for kp in kinds for kn in enumerate(lengths)):
            tag = 0x666C_6F6F_0000_0000 + (k << 20)  # "floo"
            h_conn.send(("floor", kind, n_tokens, reps, tag, puller_address))
            (regions,) = _expect(h_conn, "floor-ready", 120)
            p_conn.send(("floor", kind, n_tokens, reps, tag, holder_address, regions, pause))
            secs, buffers = _expect(p_conn, "floored", opts.timeout_s + 30)
            if kind != "tag":
                h_conn.send(("floor-done",))
            kv_bytes = kv.pages_for(n_tokens) * kv.page_bytes
            rows.append({
                "mode": after_idle(FLOORS[kind], pause), "error_handling": opts.error_handling,
                "idle_before_s": pause, "tokens": n_tokens, "kv_bytes": kv_bytes, "gdn_bytes": st.slot_bytes,
                "bytes": kv_bytes + st.slot_bytes, "buffers": buffers,
                "seconds_median": median(secs), "seconds_mean": mean(secs), "seconds": secs,
                "gb_per_s": (kv_bytes + st.slot_bytes) / median(secs) / 1e9,
            })  # fmt: skip
            label = after_idle(kind, pause)
            print(f"[floor, {label}] {n_tokens} tokens: {rows[-1]['seconds_median'] * 1e3:.2f} ms", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------------
def _expect(conn, kind: str, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {kind!r} from a child within {timeout_s:.0f}s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    if msg[0] != kind:
        raise RuntimeError(f"expected {kind!r}, got {msg!r}")
    return msg[1:]


@contextlib.contextmanager
def _processes(opts: Options):
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


class Offer(NamedTuple):
    """A state the holder prepared and offered under a lease, as the parent hears of it."""

    lease_id: str
    key: object  # transfer.LeaseKey
    descriptor: object  # its transport descriptor
    region_bytes: list[int]
    checksum: int
    kv_bytes: int
    gdn_bytes: int


def run_mode(opts: Options, lengths: list[int], reps: int, seed: int) -> tuple[list[dict], dict | None]:
    """Transfer rows for each length, and (with opts.overlap_model) the decode loop's step times."""
    mode = "on" if opts.error_handling else "off"
    spin = f", spin {opts.spin_s * 1e3:g} ms" if opts.device == "cuda" else ""
    label = f"eh-{mode}-x{opts.in_flight}" + (f"-spin{opts.spin_s * 1e3:g}" if spin else "")
    label += (f"-seq{opts.sequence}" if opts.sequence > 1 else "") + (f"-gap{opts.gap_s * 1e3:g}" if opts.gap_s else "")
    when = (f", {opts.sequence} in a row: all but the first" if opts.sequence > 1 else "") + (
        f", each {'sequence' if opts.sequence > 1 else 'pull'} after {opts.gap_s * 1e3:g} ms idle" if opts.gap_s else "")
    rows, overlap = [], None
    turns = [(n_tokens, rep) for n_tokens in lengths for rep in range(reps + 1)]
    # the holder sizes its pools for every turn it prepares up front
    opts = Options(**{**asdict(opts), "offers_first": len(turns) if opts.offers_first else 0})

    def offers_for(n_tokens: int, rep: int) -> list[Offer]:
        """The states of one turn (one or more requests), prepared and offered by the holder."""
        made = []
        for i in range(_offers_per_pull(opts)):
            lease_id = f"bench-{label}-{n_tokens}-{rep}-{i}"
            h_conn.send(("offer", lease_id, n_tokens, seed + rep * _offers_per_pull(opts) + i))
            made.append(Offer(lease_id, *_expect(h_conn, "offered", opts.timeout_s)))
        return made

    with _processes(opts) as (h_conn, p_conn):
        (address,) = _expect(h_conn, "ready", 120)
        _expect(p_conn, "ready", 300)
        # --offers-first: every turn's states, before the engine loop starts
        prepared = {turn: offers_for(*turn) for turn in turns} if opts.offers_first else {}
        h_conn.send(("start-loop",))
        if opts.overlap_model:
            time.sleep(opts.overlap_idle_s)  # the engine loop runs undisturbed: its baseline
        if opts.warm:
            h_conn.send(("pools",))
            (holder,) = _expect(h_conn, "pools", 60)
            p_conn.send(("warm", holder))
            (warm_s,) = _expect(p_conn, "warmed", opts.timeout_s + 30)
            print(f"[{label}] side channel warmed in {warm_s * 1e3:.1f} ms", flush=True)
            time.sleep(0.5 if opts.overlap_model else 0)  # steps after the warm-up, before the first pull
        for n_tokens in lengths:
            samples, info = [], {}
            for rep in range(reps + 1):
                made = prepared.pop((n_tokens, rep), None) or offers_for(n_tokens, rep)
                offers = [(o.key, o.descriptor, o.region_bytes, o.checksum) for o in made]  # what the puller needs
                regions, kv_bytes, gdn_bytes = made[-1].region_bytes, made[-1].kv_bytes, made[-1].gdn_bytes
                p_conn.send(("pull", n_tokens, offers))
                (res,) = _expect(p_conn, "pulled", opts.timeout_s + 30)
                reasons, holder_times = [], []
                for lease_id in (o.lease_id for o in made):
                    h_conn.send(("finish", lease_id))
                    reason, times = _expect(h_conn, "finished", opts.timeout_s + 30)
                    reasons.append(reason)
                    holder_times.append(times)
                if "error" in res:
                    raise RuntimeError(f"pull of {n_tokens} tokens failed: {res['error']}")
                if not res["crc_ok"]:
                    raise RuntimeError(f"pull of {n_tokens} tokens: received bytes differ from the sent ones")
                if set(reasons) != {"pulled"}:
                    raise RuntimeError(f"leases ended as {reasons!r}, expected 'pulled'")
                info = {"kv_bytes": kv_bytes, "gdn_bytes": gdn_bytes, "holder_regions": len(regions),
                        "puller_regions": res["puller_regions"], "buffers": res["buffers"]}  # fmt: skip
                if opts.sequence > 1:  # each pull its own sample but the first of each turn (it starts after a pause)
                    new = [{"seconds": x, "wall_seconds": x, "marks": [m], "phases": phases([m], [h])}
                           for x, m, h in zip(res["pull_seconds"], res["marks"], holder_times)]  # fmt: skip
                else:
                    new = [{**res, "phases": phases(res["marks"], holder_times)}]
                if rep > 0:
                    samples += new[1:] if opts.sequence > 1 else new
                else:  # reported apart: where the first pull from a peer spends its time
                    first = {"seconds": new[0]["seconds"], "phases": new[0]["phases"]}
            secs = [s["seconds"] for s in samples]
            total = (info["kv_bytes"] + info["gdn_bytes"]) * opts.in_flight
            in_flight = f", {opts.in_flight} pulls at once" if opts.in_flight > 1 else ""
            row = {
                "mode": f"ucx error handling {mode}{in_flight}{spin}{when}", "error_handling": opts.error_handling,
                "rotate": opts.rotate, "sequence": opts.sequence, "idle_before_s": opts.gap_s,
                "in_flight": opts.in_flight, "spin_ms": opts.spin_s * 1e3 if spin else None, "tokens": n_tokens,
                **info, "bytes": total, "seconds_median": median(secs), "seconds_mean": mean(secs),
                "seconds": secs, "wall_seconds": [s["wall_seconds"] for s in samples],
                "marks_ms": [[{k: round((v - m["start"]) * 1e3, 4) for k, v in m.items()} for m in s["marks"]]
                             for s in samples],
                "phases_ms_median": {
                    k: median([s["phases"][k] for s in samples if s["phases"][k] is not None]) for k in PHASES},
                "first_pull": first, "gb_per_s": total / median(secs) / 1e9, "verified": "crc32" if opts.device == "cpu" else "position-weighted sum on the GPU",
            }  # fmt: skip
            print(f"[{label}] {n_tokens} tokens: {human_bytes(total)} in {row['seconds_median'] * 1e3:.2f} ms "
                  f"= {row['gb_per_s']:.2f} GB/s, {info['buffers']} buffers", flush=True)  # fmt: skip
            rows.append(row)
        if opts.overlap_model:
            p_conn.send(("report",))
            h_conn.send(("report",))
            decode_steps, pulls, checks, warm_ups = _expect(p_conn, "overlap", 300)
            prefill_steps, preps = _expect(h_conn, "overlap", 300)
            # the benchmark's own GPU work beside the loop: checking pulled bytes (decode), seeding offers (prefill)
            if opts.overlap_side == "decode":
                summary = overlap_summary(decode_steps, pulls, checks, warm_ups)
            else:
                summary = overlap_summary(prefill_steps, pulls, preps, warm_ups)
            overlap = {"mode": label, "side": opts.overlap_side, "model": rel(opts.overlap_model),
                       "batch": opts.overlap_batch, "context": opts.overlap_context, **summary}  # fmt: skip
    return rows, overlap


PHASES = {  # where a pull's time goes: (from, to) marks of the puller (p) and the holder (h), one clock
    "puller prepares": ("p.start", "p.keys"),
    "puller posts the reads": ("p.keys", "p.posted"),
    "reads posted -> seen done": ("p.posted", "p.reads"),
    "lease word read and checked": ("p.reads", "p.done"),
    "done notice reaches holder": ("p.done", "h.done"),
}


def phases(puller_marks: list[dict], holder_times: list[dict | None]) -> dict:
    """Milliseconds of each PHASES step, the worst over the requests pulled at once."""
    pulls = [{**{f"p.{k}": v for k, v in p.items()}, **{f"h.{k}": v for k, v in (h or {}).items()}}
             for p, h in zip(puller_marks, holder_times)]  # fmt: skip
    out = {}
    for name, (a, b) in PHASES.items():
        spans = [(m[b] - m[a]) * 1e3 for m in pulls if a in m and b in m]
        out[name] = max(spans) if spans else None
    return out


def memcpy_baseline(opts: Options, lengths: list[int], reps: int, threads: int) -> list[dict]:
    """One-process torch copy of as many bytes as each length's state, single buffer."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        kv, st = _pools(opts)
        for n_tokens in lengths:
            kv_bytes = kv.pages_for(n_tokens) * kv.page_bytes
            total = kv_bytes + st.slot_bytes
            src = torch.empty(total, dtype=torch.uint8).random_(0, 256)
            dst = torch.zeros(total, dtype=torch.uint8)
            secs = []
            for rep in range(reps + 1):
                t0 = time.perf_counter()
                dst.copy_(src)
                dt = time.perf_counter() - t0
                if rep > 0:
                    secs.append(dt)
            if not torch.equal(src, dst):
                raise RuntimeError("memcpy baseline copied the wrong bytes")
            rows.append({
                "mode": f"memcpy (torch copy_, {threads} thread{'s' if threads > 1 else ''})", "error_handling": None,
                "tokens": n_tokens, "kv_bytes": kv_bytes, "gdn_bytes": st.slot_bytes, "bytes": total, "buffers": 1,
                "seconds_median": median(secs), "seconds_mean": mean(secs), "seconds": secs,
                "gb_per_s": total / median(secs) / 1e9,
            })  # fmt: skip
            del src, dst
    finally:
        torch.set_num_threads(prev)
    return rows


def peer_copy_baseline(opts: Options, lengths: list[int], reps: int, pauses: list[float]) -> list[dict]:
    """A raw device-to-device copy of the same bytes from GPU 0 to GPU 1 (NVLink when present), one buffer: back
    to back (the goal's baseline), and each after each of `pauses` with GPUs and link idle, as a pull finds them
    when requests arrive apart; those also timed on the host, from the call until both GPUs are synchronized, as
    a pull is (the CUDA-event time counts none of the launch)."""
    import torch

    kv, st = _pools(Options(**{**asdict(opts), "device": "cpu"}))  # sizes only
    rows = []
    for n_tokens in lengths:
        kv_bytes = kv.pages_for(n_tokens) * kv.page_bytes
        total = kv_bytes + st.slot_bytes
        src = torch.empty(total, dtype=torch.uint8, device="cuda:0").random_(0, 256)
        dst = torch.empty(total, dtype=torch.uint8, device="cuda:1")
        for pause_s in [0.0, *pauses]:
            gpu_secs, host_secs = [], []  # each copy timed both ways
            for rep in range(reps + 4):
                time.sleep(pause_s)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record(torch.cuda.current_stream(0))
                dst.copy_(src)
                end.record(torch.cuda.current_stream(0))
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                host_s = time.perf_counter() - t0  # as a pull is timed: from the call until the bytes are known there
                if rep >= 4:
                    gpu_secs.append(start.elapsed_time(end) / 1e3)
                    host_secs.append(host_s)
            if not torch.equal(src.cpu(), dst.cpu()):
                raise RuntimeError("peer copy baseline copied the wrong bytes")
            name = after_idle("raw GPU0->GPU1 copy", pause_s) if pause_s else "raw GPU0->GPU1 copy (torch copy_)"
            timings = [(name, gpu_secs)] + ([(f"{name}, host-timed", host_secs)] if pause_s else [])
            for mode, secs in timings:
                rows.append({
                    "mode": mode, "error_handling": None, "tokens": n_tokens, "idle_before_s": pause_s,
                    "kv_bytes": kv_bytes, "gdn_bytes": st.slot_bytes, "bytes": total, "buffers": 1,
                    "seconds_median": median(secs), "seconds_mean": mean(secs), "seconds": secs,
                    "gb_per_s": total / median(secs) / 1e9,
                })  # fmt: skip
        del src, dst
    return rows


def tokens(s: str) -> int:
    """A token count: 4096, 4k (= 4096) or 0.5k."""
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def ints(s: str) -> list[int]:
    return [tokens(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default=str(ROOT / "bench" / "configs" / "qwen3.5-9b"),
                   help="directory with the model's config.json (default: bench/configs/qwen3.5-9b)")  # fmt: skip
    p.add_argument("--lengths", type=ints, default=None, help="prompt lengths in tokens (default 128,1k,4k,8k,16k)")
    p.add_argument("--max-tokens", type=tokens, default=8192,
                   help="skip lengths above this (RAM: each of the two processes holds one request's state; "
                        "default 8k)")  # fmt: skip
    p.add_argument("--reps", type=int, default=None, help="timed pulls per length after one warm-up (default 5)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="KV and conv state dtype (default bfloat16, as served on GPU)")  # fmt: skip
    p.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="GDN recurrent state dtype (default float32)")  # fmt: skip
    p.add_argument("--ucx-error-handling", dest="error_handling", action=argparse.BooleanOptionalAction,
                   default=None, help="run only this mode (default: both, one row each)")  # fmt: skip
    p.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="requests pulled at once, e.g. 1,4: their pulls overlap; a row per value (default 1)")
    p.add_argument("--sequence", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="requests pulled one after another, back to back, e.g. 1,4: a row per value, timing every "
                        "pull but the first of each turn (default 1; these rows pull one request at a time)")
    p.add_argument("--gap-ms", type=lambda s: [float(x) for x in s.split(",")], default=[0.0],
                   help="comma list: idle milliseconds before each pull (each --sequence), the GPUs and the link "
                        "untouched; a row per value (default 0). The raw GPU copy and the --floor RMA reads get an "
                        "after-idle row per non-zero value (20 ms if none)")  # fmt: skip
    p.add_argument("--overlap-model", default=None,
                   help="also run an engine loop of this model (a checkpoint, or a config dir: dummy weights) on a "
                        "thread, as a worker does, and compare its step times before and during the pulls")
    p.add_argument("--overlap-side", choices=["decode", "prefill"], default="decode",
                   help="decode: a decode loop in the puller (default); prefill: a prefill loop in the holder")
    p.add_argument("--overlap-batch", type=int, default=8, help="requests in the engine loop's batch")
    p.add_argument("--overlap-context", type=tokens, default=1024,
                   help="decode: their context length; prefill: the prompt chunk each prefills per step")
    p.add_argument("--spin-ms", type=lambda s: [float(x) for x in s.split(",")], default=[20.0],
                   help="comma list: how long a GPU pull may spin on UCX progress (StatePuller spin_s; 0: events only)")
    p.add_argument("--warm", action="store_true",
                   help="before the first pull, run the side-channel warm-up (StatePuller.warm: a read of each of the "
                        "holder's pools and of its lease words, a notice), as a decode worker does when a prefill "
                        "worker joins; reported apart from the pulls")  # fmt: skip
    p.add_argument("--rotate", type=int, default=1,
                   help="pull into this many places of the puller's pools in turn, as a decode worker's pulls land in "
                        "pages that change from request to request (default 1: the same pages every time)")  # fmt: skip
    p.add_argument("--offers-first", action="store_true",
                   help="the holder prepares every request's state before its engine loop starts (with --overlap-side "
                        "prefill: then no seeding or summing by the benchmark runs beside the loop)")  # fmt: skip
    p.add_argument("--floor", action="store_true",
                   help="also move the same buffers with bare tag messages and with bare RMA reads, spinning on UCX "
                        "progress (no lease, protocol or event loop): what UCX itself needs")  # fmt: skip
    p.add_argument("--memcpy-threads", type=int, default=1, help="torch threads for the memcpy baseline")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per pull / lease TTL")
    p.add_argument("--ucx-proto-info", action="store_true", help="let UCX print its protocol choices (UCX_PROTO_INFO)")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 and 1k tokens, 2 reps")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: pools on GPU 0 (holder) and GPU 1 (puller); baseline = raw peer copy")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "transfer_cpu.json"), help="JSON results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    max_tokens = args.max_tokens
    lengths = args.lengths or ([128, 1024] if args.quick else [128, 1024, 4096, 8192, 16384])
    skipped = [n for n in lengths if n > max_tokens]
    lengths = [n for n in lengths if n <= max_tokens]
    if not lengths:
        raise SystemExit(f"every length is above --max-tokens {max_tokens}")
    reps = args.reps or (2 if args.quick else 5)
    modes = [args.error_handling] if args.error_handling is not None else [True, False]
    started = utc_now()
    warning = busy_warning()
    if warning:
        print(warning, flush=True)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    if skipped:
        print(f"skipping lengths above --max-tokens {max_tokens}: {skipped}", flush=True)
    rows, overlaps = [], []
    turns = [(n, 1) for n in args.in_flight] + [(1, n) for n in args.sequence if n > 1]  # (in flight, in a row)
    for eh in modes:
        for spin_ms in args.spin_ms if args.device == "cuda" else [0.0]:
            for (in_flight, sequence), gap_ms in ((turn, gap) for turn in turns for gap in args.gap_ms):
                opts = Options(args.model_config, args.dtype, args.state_dtype, max(lengths), eh, args.timeout,
                               args.ucx_proto_info, args.device, in_flight, overlap_model=args.overlap_model,
                               overlap_side=args.overlap_side, overlap_batch=args.overlap_batch,
                               overlap_context=args.overlap_context, spin_s=spin_ms / 1e3, warm=args.warm,
                               rotate=args.rotate, sequence=sequence, gap_s=gap_ms / 1e3,
                               offers_first=args.offers_first)  # fmt: skip
                mode_rows, overlap = run_mode(opts, lengths, reps, args.seed)
                rows += mode_rows
                overlaps += [overlap] if overlap else []
    opts = Options(args.model_config, args.dtype, args.state_dtype, max(lengths), modes[0], args.timeout,
                   args.ucx_proto_info, args.device)  # fmt: skip
    pauses = sorted({gap / 1e3 for gap in args.gap_ms if gap}) or [DEFAULT_PAUSE_S]  # the after-idle rows
    if args.floor:
        rows += run_floor(opts, lengths, reps, pauses)
    if args.device == "cuda":
        rows += peer_copy_baseline(opts, lengths, reps, pauses)
    else:
        rows += memcpy_baseline(opts, lengths, reps, args.memcpy_threads)

    from engine.config import ModelConfig

    mc = ModelConfig.from_dir(args.model_config)
    try:
        import ucxx

        ucxx_version = ucxx.__version__
    except Exception:  # noqa: BLE001
        ucxx_version = None
    payload = {
        "benchmark": "transfer_cpu",
        "command": command_line(),
        "date_utc": started,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "machine": {**machine_info(), "ucxx": ucxx_version},
        "settings": {
            "model_config": rel(args.model_config), "family": mc.family, "full_attention_layers": len(mc.full_layers),
            "gdn_layers": len(mc.linear_layers), "page_size": PAGE_SIZE, "dtype": args.dtype,
            "state_dtype": args.state_dtype, "reps": reps, "warmup": 1, "lengths": lengths,
            "skipped_lengths": skipped, "ucx_net_devices": "lo", "memcpy_threads": args.memcpy_threads,
            "load_average_1m_start": load_start, "busy_warning": warning,
            "timed": "StatePuller.pull: called -> every segment received and the lease word checked; median of reps "
                     "after 1 warm-up",
        },  # fmt: skip
        "results": rows,
        "overlap": overlaps,
    }
    out = write_json(args.out, payload)
    print()
    print(f"transfer_cpu  {started}  {Path(args.model_config).name} (KV {args.dtype}, GDN state {args.state_dtype})  "
          f"{payload['machine']['cpu_model']}  {payload['machine']['cpus_usable']} CPUs  -> {out}")  # fmt: skip
    print(table(
        ["mode", "tokens", "KV bytes", "GDN bytes", "buffers", "median ms", "mean ms", "GB/s"],
        [[r["mode"], r["tokens"], human_bytes(r["kv_bytes"]), human_bytes(r["gdn_bytes"]), r["buffers"],
          r["seconds_median"] * 1e3, r["seconds_mean"] * 1e3, r["gb_per_s"]] for r in rows],
    ))  # fmt: skip
    pulls = [r for r in rows if "phases_ms_median" in r]
    print("\nwhere a pull's time goes (median ms; one clock for both processes)")
    print(table(["mode", "tokens", *PHASES], [[r["mode"], r["tokens"], *r["phases_ms_median"].values()] for r in pulls]))
    print("\nthe dropped first pull of each row (ms)")
    print(table(["mode", "tokens", "pull", *PHASES],
                [[r["mode"], r["tokens"], r["first_pull"]["seconds"] * 1e3, *r["first_pull"]["phases"].values()]
                 for r in pulls]))  # fmt: skip
    if overlaps:
        where = "a decode loop in the puller" if args.overlap_side == "decode" else "a prefill loop in the holder"
        own = "check of the pulled bytes" if args.overlap_side == "decode" else "seeding and summing of each offer"
        print(f"\n{where} (step ms): before the first pull vs steps that overlapped a pull (median / p99 / max);"
              f" apart: steps that overlapped a pull but not the benchmark's own {own}, and those that did")

        def span(st: dict) -> str:
            return f"{st['median_ms']:.1f} / {st['p99_ms']:.1f} / {st['max_ms']:.1f}" if st["steps"] else "-"

        print(table(
            ["mode", "model", "batch", "context" if args.overlap_side == "decode" else "chunk", "idle steps", "idle",
             "during steps", "during pulls", "pull, no bench work", "during bench work"],
            [[o["mode"], o["model"], o["batch"], o["context"], o["idle"]["steps"], span(o["idle"]),
              o["during_pulls"]["steps"], span(o["during_pulls"]), span(o["during_pulls_not_checks"]),
              span(o["during_checks"])] for o in overlaps],
        ))  # fmt: skip
        longest = "longest step during it (ms)"
        print(table(["mode", "warm-up ms", longest, "first pull ms", longest],
                    [[o["mode"], ", ".join(map(str, o["warm_up_ms"])) or "-",
                      ", ".join(map(str, o["max_step_ms_per_warm_up"])) or "-", o["pull_ms"][0],
                      o["max_step_ms_per_pull"][0]] for o in overlaps]))  # fmt: skip
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
