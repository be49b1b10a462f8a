import openai
import pytest

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig


@pytest.fixture(scope="session")
def reference_engine():
    """The monolithic engine on the default model: what the mesh must reproduce token for token."""
    with Engine(EngineConfig(model=str(DEFAULT_MODEL))) as engine:
        yield engine


@pytest.fixture(scope="module")
def base_url(mesh):
    """The REST gateway of the module's own `mesh` fixture (a mesh started with http=True)."""
    return f"http://127.0.0.1:{mesh.http_port}"


@pytest.fixture(scope="module")
def client(base_url):
    """The official openai client on that gateway."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session", autouse=True)
def reliability_table(tmp_path_factory):
    """Writes the fault suite's measurements at the end of the session."""
    import reliability

    yield
    reliability.write(tmp_path_factory.getbasetemp())
