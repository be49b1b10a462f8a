"""Prefill worker process."""

from __future__ import annotations

import asyncio

from deltamesh.v1 import prefill_pb2, prefill_pb2_grpc
from deltamesh.services.common.settings import WorkerSettings
from deltamesh.services.common.worker import Worker, serve_worker
from deltamesh.services.prefill.servicer import PrefillServicer, expire_leases
from deltamesh.transfer import LeaseTable, Transport


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    def setup(worker: Worker, transport: Transport):
        leases = LeaseTable(capacity=worker.engine.num_state_slots)  # a lease holds a state slot
        holder = transport.holder(leases)
        servicer = PrefillServicer(worker, leases, holder)
        name = prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
        services = [(prefill_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer, name)]
        worker.transport_descriptor = servicer.transport_descriptor
        return services, holder.start, holder.stop, lambda s: [expire_leases(leases, s)], leases

    await serve_worker(settings, stop, setup)
