"""The OpenAI-compatible REST gateway (FastAPI on uvicorn), served by the router process on the same event
loop as its gRPC front door and calling the same `Mesh`.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events
ending in `data: [DONE]`), GET /v1/models, GET /health (liveness), GET /ready (readiness: are there workers
to serve), GET /metrics (Prometheus), and vLLM's POST /tokenize, POST /detokenize and GET /version. Errors use
OpenAI's JSON error shape.

Modules: `app` builds the app around one `Gateway` (its dependencies); `health`, `completions`, `chat` and
`tokens` hold the routes; `choices` turns a request into choices, `generation` runs them in the mesh, `reply` answers whole
or as a stream (`streaming`); `errors` and `middleware` shape errors and guard /v1 and the token routes; `server` embeds uvicorn.
"""

from deltamesh.services.router.gateway.app import create_app
from deltamesh.services.router.gateway.dependencies import Gateway
from deltamesh.services.router.gateway.server import start_gateway

__all__ = ["Gateway", "create_app", "start_gateway"]
