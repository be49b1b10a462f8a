import pytest

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig


@pytest.fixture(scope="session")
def reference_engine():
    """The monolithic engine on the default model: what the mesh must reproduce token for token."""
    with Engine(EngineConfig(model=str(DEFAULT_MODEL))) as engine:
        yield engine


@pytest.fixture(scope="session", autouse=True)
def reliability_table(tmp_path_factory):
    """Writes the fault suite's measurements at the end of the session."""
    import reliability

    yield
    reliability.write(tmp_path_factory.getbasetemp())
