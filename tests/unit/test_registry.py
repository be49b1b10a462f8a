import pytest
import torch

from deltamesh.kernels import ModelShapes, select_kernels
from deltamesh.kernels.registry import _BACKENDS, OPS, Backend, parse_override, register_backend

SHAPES = ModelShapes(torch.float32, torch.float32, 2, 4, 16, 16, 4, 2, 32, 16)


def test_cpu_picks_the_torch_reference_for_every_op():
    k = select_kernels(torch.device("cpu"), SHAPES)
    assert k.chosen == {op: "torch" for op in OPS}


def test_overrides_parse_and_unknown_names_are_rejected():
    assert parse_override("torch") == {op: "torch" for op in OPS}
    assert parse_override("gdn_decode=fla, paged_attention=torch") == {"gdn_decode": "fla", "paged_attention": "torch"}
    assert parse_override("auto") == {}
    with pytest.raises(ValueError, match="unknown kernel op"):
        parse_override("gdn_everything=torch")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        select_kernels(torch.device("cpu"), SHAPES, "cuda-magic")


def test_higher_priority_backend_wins_per_op_and_can_be_forced_away():
    calls = []

    def load(device, shapes):
        calls.append(device.type)
        return {"gdn_decode": lambda *a: "fast"}, "only decode here"

    register_backend(Backend("test-fast", 50, load))
    try:
        k = select_kernels(torch.device("cpu"), SHAPES)
        assert k.chosen["gdn_decode"] == "test-fast" and k.chosen["gdn_prefill"] == "torch"
        assert select_kernels(torch.device("cpu"), SHAPES, "gdn_decode=torch").chosen["gdn_decode"] == "torch"
        with pytest.raises(ValueError, match="cannot run gdn_prefill"):
            select_kernels(torch.device("cpu"), SHAPES, "gdn_prefill=test-fast")
    finally:
        del _BACKENDS["test-fast"]
    assert calls
