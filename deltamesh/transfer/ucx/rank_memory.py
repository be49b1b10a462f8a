"""A parallel worker's other ranks (follower processes): their pools made readable over UCX where they are, so
that a state held there (a tensor-parallel rank's part, or a data-parallel rank's whole state) leaves from there
(holder.py, `UcxHolder.add_ranks`), not through a copy on the first rank.

Each such rank calls `export` once at start (UcxTransport.rank_exporter, through the engine's settings). It
posts nothing itself: its UCX worker's progress thread only answers what UCX needs of the memory's owner (the
reads it emulates over TCP, connection set-up); pullers read with the keys the first rank hands out.
"""

from __future__ import annotations

import atexit

import torch

from deltamesh.transfer.ucx import rma
from deltamesh.v1 import ucx_pb2

_kept: list = []  # the context, worker and registrations: as long as the process


def export(views: list[torch.Tensor]) -> bytes:
    """Register `views` (whole allocations, 1-D byte views) with a UCX worker of this process's own; a
    UcxRankMemory message: the worker's address and each registration's start, size and packed key."""
    from ucxx._lib import libucxx as ucx

    context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.RMA, ucx.Feature.WAKEUP))
    worker = ucx.UCXWorker(context)
    worker.start_progress_thread()  # blocking progress: asleep until UCX has something to do
    registrations = [
        rma.Registration(context.handle, v.data_ptr(), v.numel(), rma.memory_type(v.is_cuda)) for v in views
    ]
    _kept.append((context, worker, registrations))
    atexit.register(_close)
    return ucx_pb2.UcxRankMemory(
        worker_address=worker.address.tobytes(),
        starts=[r.address for r in registrations],
        sizes=[r.length for r in registrations],
        rkeys=[r.rkey for r in registrations],
    ).SerializeToString()


def _close() -> None:
    """At exit: the progress thread stopped before the worker goes (ucxx asks for it), the memory unregistered."""
    for _context, worker, registrations in _kept:
        worker.stop_progress_thread()
        for r in registrations:
            r.close()
    _kept.clear()
