"""The routes that describe the server rather than run the model: liveness, readiness, Prometheus metrics and
the model list."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.gateway.choices import unknown_model
from deltamesh.services.router.gateway.dependencies import GatewayDep
from deltamesh.services.router.gateway.errors import ApiError

router = APIRouter()


@router.get("/health", summary="Liveness")
async def health() -> dict:
    return {"status": "ok"}


@router.get(
    "/ready", summary="Readiness: healthy workers to serve requests", responses={503: {"model": oa.ErrorResponse}}
)
async def ready(gateway: GatewayDep):
    if missing := gateway.mesh.missing():
        return ApiError(503, missing, "service_unavailable").response()
    healthy = [w.role for w in gateway.mesh.registry.workers.values() if w.healthy]
    answer: dict[str, object] = {
        "status": "ready",
        "workers": {role: healthy.count(role) for role in sorted(set(healthy))},
    }
    if gateway.process is not None:  # one of several router processes: the one this connection reached
        answer["process"] = gateway.process
    return answer


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=oa.ModelList)
async def models(gateway: GatewayDep) -> oa.ModelList:
    return oa.ModelList(data=[_card(gateway)])


@router.get("/v1/models/{model:path}", response_model=oa.ModelCard, responses={404: {"model": oa.ErrorResponse}})
async def model(model: str, gateway: GatewayDep):
    if not gateway.frontend.serves(model):
        return unknown_model(gateway.frontend, model).response()
    return _card(gateway)


def _card(gateway) -> oa.ModelCard:
    f = gateway.frontend
    return oa.ModelCard(id=f.model_id, created=0, max_model_len=f.max_model_len, root=f.model_path)
