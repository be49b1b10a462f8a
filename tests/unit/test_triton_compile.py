"""Triton kernels compiled for the H200 (sm_90) on a machine without a GPU: Triton's front end, LLVM and ptxas
run on the CPU, so a kernel that would not compile for the GPU fails here, in CI. The pair-wise MoE kernels,
bf16 as a decode step runs them."""

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deltamesh.kernels import triton_moe  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


def compile_for_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object]):
    signature = signature | {name: "constexpr" for name in constexprs}
    signature = {name: signature[name] for name in kernel.arg_names}  # in the kernel's own order
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=SM90)


@pytest.mark.parametrize("norm", [True, False])
def test_pairwise_moe_kernels_compile_for_sm90(norm):
    ints = dict.fromkeys(("H", "I", "IS", "stride_we", "stride_wn", "stride_swn"), "i32")
    gate_up = compile_for_sm90(
        triton_moe._gate_up_silu_pairs,
        {"x": "*bf16", "logits": "*bf16", "shared_gate": "*bf16", "w13": "*bf16", "sw13": "*bf16", "inter": "*bf16",
         "ids": "*i32", "weights": "*fp32"} | ints | {"stride_x": "i32", "stride_l": "i32", "stride_g": "i32"},
        {"E": 256, "BLOCK_E": 256, "TOP_K": 8, "NORM": norm, "BLOCK_N": 16, "BLOCK_K": 256},
    )  # fmt: skip
    down = compile_for_sm90(
        triton_moe._down_combine,
        {"inter": "*bf16", "w2": "*bf16", "sw2": "*bf16", "ids": "*i32", "weights": "*fp32", "out": "*bf16"} | ints,
        {"TOP_K": 8, "BLOCK_N": 16, "BLOCK_K": 256},
    )  # fmt: skip
    for k in (gate_up, down):
        assert k.asm["cubin"] and ".target sm_90" in k.asm["ptx"]
