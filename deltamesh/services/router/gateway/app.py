"""The gateway's FastAPI app: its routers, error handlers and the middleware that guards /v1 and the token routes,
all served from one `Gateway` (frontend, mesh, API key) that the routes read from `app.state`."""

from __future__ import annotations

from fastapi import FastAPI

from deltamesh.services.router import metrics as router_metrics
from deltamesh.services.router.gateway import chat, completions, health, tokens
from deltamesh.services.router.gateway.dependencies import Gateway
from deltamesh.services.router.gateway.errors import ERROR_RESPONSES, add_error_handlers
from deltamesh.services.router.gateway.middleware import LimitsAndAuth


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(
        title="deltamesh",
        version=tokens.PACKAGE_VERSION,
        summary="OpenAI-compatible API of a deltamesh router",
        responses=ERROR_RESPONSES,
    )
    app.state.gateway = gateway
    # vLLM's series carry the served model's name and count tokens up to its context length
    router_metrics.VLLM.name(gateway.frontend.model_id, gateway.frontend.max_model_len)
    add_error_handlers(app)
    app.add_middleware(
        LimitsAndAuth, api_key=gateway.api_key, limits=gateway.frontend.limits, body_timeout_s=gateway.body_timeout_s
    )
    for module in (health, completions, chat, tokens):
        app.include_router(module.router)
    return app
