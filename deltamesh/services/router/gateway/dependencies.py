"""What the gateway's routes depend on, as one object: the frontend (tokenizer, limits, request checks), the
mesh that runs requests, the API key, the body deadline and the model's reasoning / tool-call format. `create_app` stores it on `app.state`; a route asks for it with a
`GatewayDep` parameter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from deltamesh.services.router.chat_output import OutputFormat
from deltamesh.services.router.frontend import Frontend
from deltamesh.services.router.mesh import Mesh


@dataclass(frozen=True)
class Gateway:
    frontend: Frontend
    mesh: Mesh
    api_key: str | None = None
    body_timeout_s: float = 30.0  # for a request's body, once its headers are in
    output_format: OutputFormat = OutputFormat()  # how the model writes reasoning and tool calls
    process: int | None = None  # which of the router's processes this is (--api-server-count > 1), for /ready

    def token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id], skip_special_tokens=False) if self.frontend.tokenizer else ""


async def _gateway(request: Request) -> Gateway:
    # async: FastAPI runs a plain def dependency in its thread pool, a thread hop (and a yield of the loop) on
    # every request before its body is looked at
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]
