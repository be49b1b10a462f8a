import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{family: directory} of tiny random checkpoints written by transformers."""
    from hf_checkpoints import BUILDERS, write_checkpoint

    base = tmp_path_factory.mktemp("hf")
    return {fam: write_checkpoint(fam, base / fam, seed=i) for i, fam in enumerate(BUILDERS)}
