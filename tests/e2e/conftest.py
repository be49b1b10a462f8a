import pytest

from engine import DEFAULT_MODEL, Engine, EngineConfig


@pytest.fixture(scope="session")
def reference_engine():
    """The monolithic engine on the default model: what the mesh must reproduce token for token."""
    with Engine(EngineConfig(model=str(DEFAULT_MODEL))) as engine:
        yield engine
