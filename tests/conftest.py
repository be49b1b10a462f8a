import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# The cores shared among pytest-xdist's workers, at most 2 threads each: torch thread pools that outnumber the
# cores spin against each other instead of computing.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

# Every test of these directories carries its marker, so that `-m` selections (make test-fast, test-gpu,
# reliability) see all of them. (Not `marker in item.keywords`: keywords hold the directory's name too.)
DIRECTORY_MARKERS = {"e2e": "e2e", "fidelity": "fidelity", "gpu": "gpu"}


def pytest_xdist_make_scheduler(config, log):
    """Under `-n N` (--dist load, make test): the tests of one e2e module on one worker, in their order, so that a
    mesh they share starts once; every other test on whichever worker is free. The units go out largest first,
    then the tests marked `slow`, so that no worker is left with a long one at the end. (--dist loadgroup would
    do the grouping from marks, but on pytest 9.2 it groups nothing: pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class E2eModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.startswith("tests/e2e/") else nodeid

    return E2eModulesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order
    unmarked = sorted(
        {
            f"{item.path.relative_to(ROOT)} (needs '{marker}')"
            for item in items
            if (marker := DIRECTORY_MARKERS.get(item.path.parent.name)) and not item.get_closest_marker(marker)
        }
    )
    if unmarked:
        raise pytest.UsageError(f"tests without their directory's marker: {', '.join(unmarked)}")
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{family: directory} of tiny random checkpoints written by transformers."""
    from hf_checkpoints import BUILDERS, write_checkpoint

    base = tmp_path_factory.mktemp("hf")
    return {fam: write_checkpoint(fam, base / fam, seed=i) for i, fam in enumerate(BUILDERS)}
