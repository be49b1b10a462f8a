"""The router's control plane: workers register (and again whenever this process does not watch them:
services/common/registration.py) and operators read the workers' loads. Served on a listener of its own, for callers
holding the mesh secret only."""

from __future__ import annotations

import grpc
import structlog

from deltamesh.services.common.auth import mesh_metadata
from deltamesh.services.router.registry import WorkerRegistry
from deltamesh.v1 import common_pb2, control_pb2, control_pb2_grpc

log = structlog.get_logger("deltamesh.router")


class ControlServicer(control_pb2_grpc.MeshControlServicer):
    def __init__(self, registry: WorkerRegistry, model_id: str, control_ports: list[int]):
        """`control_ports`: the control-plane ports of every process of this router, told to registering workers so
        that they register with each."""
        self.registry, self.model_id, self.control_ports = registry, model_id, control_ports

    async def RegisterWorker(self, request: control_pb2.RegisterWorkerRequest, context):
        try:
            self.registry.add(request.address, request.role, static=False, compat_hash=request.compat_hash)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.model and request.model != self.model_id:
            log.warning("worker serves another model", address=request.address, model=request.model)
        return control_pb2.RegisterWorkerResponse(
            heartbeat_interval_ms=int(self.registry.heartbeat_interval_s * 1000),
            router_control_ports=self.control_ports,
            router_id=self.registry.id,
        )

    async def GetLoads(self, request, context) -> common_pb2.GetLoadsResponse:
        return common_pb2.GetLoadsResponse(workers=self.registry.loads())


def read_loads(
    address: str, secret: str, credentials: grpc.ChannelCredentials | None = None, timeout: float = 5.0
) -> list[common_pb2.WorkerLoad]:
    """Every worker's load as the router at control-plane `address` sees it (for operators, tests and benchmarks;
    `credentials` for a mesh on TLS)."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        reply = control_pb2_grpc.MeshControlStub(channel).GetLoads(
            common_pb2.GetLoadsRequest(), metadata=mesh_metadata(secret), timeout=timeout
        )
    return list(reply.workers)
