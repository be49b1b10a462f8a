"""What bench/transfer.py measures a pull against: UCX's own floors and raw copies of the same bytes.

Floors: the state's buffers moved with no lease, no protocol and no event loop, spinning on UCX progress; what
UCX itself needs once the puller has asked (tag: a small "go" message, then the rendezvous of every buffer; RMA:
the reads alone, as a pull posts them). Their distance to a pull is what the transport's own code costs; their
distance to the raw copy is UCX's. Raw copies: a single-buffer torch copy in one process (CPU), or a GPU 0 ->
GPU 1 peer copy (NVLink when present).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from bench.common import mean, median

DEFAULT_PAUSE_S = 0.02  # the "after idle" rows of the raw copy and the RMA floor, when --gap-ms names no pause
FLOORS = {
    "tag": "floor: bare tag messages, spinning on UCX progress",
    "rma": "floor: bare RMA reads, spinning on UCX progress",
    "loop": "floor: bare RMA reads through the event loop",
}
Sizes = Callable[[int], tuple[int, int]]  # tokens -> (KV bytes, GDN state bytes) of one request's state


def after_idle(mode: str, pause_s: float) -> str:
    """A row's mode, naming the idle pause before each of its reps (if any)."""
    return f"{mode}, each after {pause_s * 1e3:g} ms idle" if pause_s else mode


def result_row(
    mode: str, tokens: int, kv_bytes: int, gdn_bytes: int, secs: list[float], nbytes: int | None = None, **extra
) -> dict:
    """One row of results: `secs` the timed reps; `nbytes` what they moved (default: one state)."""
    nbytes = nbytes if nbytes is not None else kv_bytes + gdn_bytes
    return {
        "mode": mode,
        "tokens": tokens,
        "kv_bytes": kv_bytes,
        "gdn_bytes": gdn_bytes,
        "bytes": nbytes,
        **extra,
        "seconds_median": median(secs),
        "seconds_mean": mean(secs),
        "seconds": secs,
        "gb_per_s": nbytes / median(secs) / 1e9,
    }


# ---------------------------------------------------------------------------------------------------
# Floors (run in the benchmark's holder and puller processes)
# ---------------------------------------------------------------------------------------------------
_RMA_FLOOR_EPS: dict[bytes, object] = {}  # holder address -> endpoint, kept open as a puller keeps its own


def _ucx_buffer(t):
    """What ucxx's Array takes: numpy for host memory, the tensor itself (CUDA array interface) on a GPU."""
    return t if t.is_cuda else t.numpy()


def _spin(worker, request) -> None:
    while not request.completed:
        worker.progress()
    request.check_error()


def _tag_tools(peer_address: bytes, error_handling: bool):
    from ucxx._lib.arr import Array
    from ucxx._lib.libucxx import UCXXTag

    from deltamesh.transfer.ucx import loop_worker

    ucx = loop_worker.get()
    return ucx.worker, ucx.endpoint(peer_address, error_handling), Array, UCXXTag


def floor_holder(puller_address: bytes, buffers, reps: int, tag: int, error_handling: bool) -> None:
    """Tag floor, holder side: on each "go", send every buffer."""
    import numpy as np

    worker, ep, Array, UCXXTag = _tag_tools(puller_address, error_handling)
    go = np.zeros(8, dtype=np.uint8)
    try:
        for _ in range(reps + 1):
            _spin(worker, worker.tag_recv(Array(go), UCXXTag(tag)))
            for request in [ep.tag_send(Array(_ucx_buffer(b)), UCXXTag(tag + 1 + i)) for i, b in enumerate(buffers)]:
                _spin(worker, request)
    finally:
        ep.close()


def floor_puller(holder_address: bytes, buffers, reps: int, tag: int, error_handling: bool) -> list[float]:
    """Tag floor, puller side: post every receive, say "go", wait for all."""
    import numpy as np

    worker, ep, Array, UCXXTag = _tag_tools(holder_address, error_handling)
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
    """What both RMA floors read with: the worker, the endpoint to the holder, the holder's keys unpacked for it
    (destroyed afterwards) and the plan of segments, as a pull makes it."""
    from deltamesh.transfer import segments
    from deltamesh.transfer.ucx import loop_worker, rma

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


def floor_rma_puller(
    holder_address: bytes, regions, buffers, reps: int, error_handling: bool, pause_s: float = 0.0
) -> list[float]:
    """The RMA floor: the reads a pull posts (one per segment, keys unpacked once), spinning on UCX progress until
    all are done; no lease check, no event loop. `pause_s`: the process, GPUs and link idle this long before each
    rep (what a pull after a pause starts from)."""
    from deltamesh.transfer.ucx import rma

    memory = rma.memory_type(buffers[0].is_cuda)
    secs = []
    with _rma_floor(holder_address, regions, buffers, error_handling) as (ucx, ep, keys, plan):
        for _ in range(reps + 1):
            time.sleep(pause_s)
            t0 = time.perf_counter()
            reads = [
                rma.GetRequest(
                    ep.handle, buffers[j].data_ptr() + dst_off, n, regions[i].address + src_off, keys[i], memory
                )
                for i, src_off, j, dst_off, n in plan
            ]
            for read in reads:
                _spin(ucx.worker, read)
            secs.append(time.perf_counter() - t0)
    return secs[1:]  # the first is the warm-up


async def floor_rma_loop(
    holder_address: bytes, regions, buffers, reps: int, error_handling: bool, spin_s: float
) -> list[float]:
    """The same reads, posted and awaited through the event loop as a pull does (with its spin setting), still
    without the lease check: its distance to the RMA floor is the event loop's cost, its distance to a pull the
    check's."""
    spin_s = spin_s if buffers[0].is_cuda else 0.0
    secs = []
    with _rma_floor(holder_address, regions, buffers, error_handling) as (ucx, ep, keys, plan):
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            await asyncio.gather(
                *(
                    ucx.get(ep, buffers[j][dst_off : dst_off + n], regions[i].address + src_off, keys[i], spin_s=spin_s)
                    for i, src_off, j, dst_off, n in plan
                )
            )
            secs.append(time.perf_counter() - t0)
    return secs[1:]  # the first is the warm-up


def close_floor_endpoints() -> None:
    """While CUDA is up: left to the process's exit, UCX's clean-up found it gone."""
    for ep in _RMA_FLOOR_EPS.values():
        ep.close()
    _RMA_FLOOR_EPS.clear()


# ---------------------------------------------------------------------------------------------------
# Raw copies (run in the parent)
# ---------------------------------------------------------------------------------------------------
def memcpy_baseline(sizes: Sizes, lengths: list[int], reps: int, threads: int) -> list[dict]:
    """One-process torch copy of as many bytes as each length's state, single buffer."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for n_tokens in lengths:
            kv_bytes, gdn_bytes = sizes(n_tokens)
            src = torch.empty(kv_bytes + gdn_bytes, dtype=torch.uint8).random_(0, 256)
            dst = torch.zeros_like(src)
            secs = []
            for rep in range(reps + 1):
                t0 = time.perf_counter()
                dst.copy_(src)
                if rep > 0:
                    secs.append(time.perf_counter() - t0)
            if not torch.equal(src, dst):
                raise RuntimeError("memcpy baseline copied the wrong bytes")
            mode = f"memcpy (torch copy_, {threads} thread{'s' if threads > 1 else ''})"
            rows.append(result_row(mode, n_tokens, kv_bytes, gdn_bytes, secs, error_handling=None, buffers=1))
    finally:
        torch.set_num_threads(prev)
    return rows


def peer_copy_baseline(sizes: Sizes, lengths: list[int], reps: int, pauses: list[float]) -> list[dict]:
    """A raw device-to-device copy of the same bytes from GPU 0 to GPU 1, one buffer: back to back (the goal's
    baseline), and each after each of `pauses` with GPUs and link idle, as a pull finds them when requests arrive
    apart; those also timed on the host, from the call until both GPUs are synchronized, as a pull is (the
    CUDA-event time counts none of the launch)."""
    import torch

    rows = []
    for n_tokens in lengths:
        kv_bytes, gdn_bytes = sizes(n_tokens)
        src = torch.empty(kv_bytes + gdn_bytes, dtype=torch.uint8, device="cuda:0").random_(0, 256)
        dst = torch.empty(kv_bytes + gdn_bytes, dtype=torch.uint8, device="cuda:1")
        for pause_s in [0.0, *pauses]:
            gpu_secs, host_secs = _timed_peer_copies(src, dst, reps, pause_s)
            if not torch.equal(src.cpu(), dst.cpu()):
                raise RuntimeError("peer copy baseline copied the wrong bytes")
            name = after_idle("raw GPU0->GPU1 copy", pause_s) if pause_s else "raw GPU0->GPU1 copy (torch copy_)"
            timings = [(name, gpu_secs)] + ([(f"{name}, host-timed", host_secs)] if pause_s else [])
            rows += [
                result_row(
                    mode, n_tokens, kv_bytes, gdn_bytes, secs, error_handling=None, idle_before_s=pause_s, buffers=1
                )
                for mode, secs in timings
            ]
        del src, dst
    return rows


def _timed_peer_copies(src, dst, reps: int, pause_s: float) -> tuple[list[float], list[float]]:
    """Each copy after 4 untimed ones, timed by CUDA events and on the host."""
    import torch

    gpu_secs, host_secs = [], []
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
    return gpu_secs, host_secs
