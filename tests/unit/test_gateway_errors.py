"""The REST gateway's error responses: OpenAI's error shape, and a Retry-After hint where coming back soon
helps (no worker yet: 503; no room in the mesh now: 429), none where it does not."""

import grpc

from deltamesh.services.router.gateway.errors import ApiError
from deltamesh.services.router.mesh import MeshError


def test_busy_and_unavailable_meshes_tell_the_client_when_to_retry():
    full = ApiError.from_mesh(MeshError(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker is full"))
    down = ApiError.from_mesh(MeshError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker"))
    bad = ApiError(400, "max_tokens: too large", param="max_tokens")
    assert [e.response().status_code for e in (full, down, bad)] == [429, 503, 400]
    assert [e.response().headers.get("retry-after") for e in (full, down, bad)] == ["1", "1", None]
    assert full.detail.type == "rate_limit_exceeded" and bad.detail.param == "max_tokens"
