"""vLLM's --chat-template on a real router: its REST gateway renders chats with the given template instead of the
checkpoint's (POST /tokenize's chat form counts the prompt a chat completion would send)."""

import time

import httpx
import pytest
from harness import READY_TIMEOUT_S, Mesh

from deltamesh.engine import DEFAULT_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.api]
TEMPLATE = "{% for m in messages %}<<custom {{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}<<reply>>"


def test_the_router_renders_chats_with_the_given_template(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    mesh = Mesh(str(DEFAULT_MODEL), tmp_path, router_args=["--chat-template", str(template)])
    mesh.start_router(http=True)  # no worker: the token routes never reach the mesh
    url = f"http://127.0.0.1:{mesh.http_port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                tokenized = httpx.post(
                    f"{url}/tokenize", json={"messages": [{"role": "user", "content": "What is a tuple?"}]}, timeout=5
                )
                break
            except httpx.HTTPError:
                assert mesh.procs[0].alive() and time.monotonic() < deadline, mesh.procs[0].log.read_text()[-3000:]
                time.sleep(0.1)
        assert tokenized.status_code == 200, tokenized.text
        prompt = httpx.post(f"{url}/detokenize", json={"tokens": tokenized.json()["tokens"]}, timeout=5).json()
        assert prompt == {"prompt": "<<custom user>>What is a tuple?\n<<reply>>"}
    finally:
        mesh.stop()
