"""Triton kernels compiled for the H200 (sm_90) on a machine without a GPU: Triton's front end, LLVM and ptxas
run on the CPU, so a kernel that would not compile for the GPU fails here, in CI. The pair-wise MoE kernels,
bf16 and FP8 as a decode step runs them, and the FP8 tensor-core kernels."""

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deltamesh.kernels import (  # noqa: E402
    triton_gemv,
    triton_gemv_kernels,
    triton_linear,
    triton_moe_aligned,
    triton_moe_pairs,
)

SM90 = GPUTarget("cuda", 90, 32)


def compile_for_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object], num_warps: int = 4):
    """As a launch with programmatic dependent launch on (kernels/pdl.py, mode 3: the wait, the GEMV's weight
    prefetch and the early trigger) compiles it (without it, the same kernel less those branches)."""
    constexprs = {"PDL": 3} | constexprs if "PDL" in kernel.arg_names else constexprs
    signature = signature | {name: "constexpr" for name in constexprs}
    signature = {name: signature[name] for name in kernel.arg_names}  # in the kernel's own order
    options = {"num_warps": num_warps, "launch_pdl": "PDL" in constexprs}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=SM90, options=options
    )
    for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
        assert (instruction in compiled.asm["ptx"]) == options["launch_pdl"]
    return compiled


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 4])
def test_pairwise_moe_kernels_compile_for_sm90(tokens, norm, fp8):
    """With the tiles a decode step of `tokens` tokens uses."""
    gate_up_tile, down_tile = triton_moe_pairs.pair_config(tokens)
    w = "*fp8e4nv" if fp8 else "*bf16"
    ints = dict.fromkeys(
        (
            "H",
            "I",
            "IS",
            "stride_we",
            "stride_wn",
            "stride_swn",
            "stride_se",
            "stride_sn",
            "stride_ssn",
            "first",
            "local",
        ),
        "i32",
    )
    scales = {"w13_s": "*fp32", "sw13_s": "*fp32"}
    gate_up = compile_for_sm90(
        triton_moe_pairs._gate_up_silu_pairs,
        {
            "x": "*bf16",
            "logits": "*bf16",
            "shared_gate": "*bf16",
            "w13": w,
            "sw13": w,
            "inter": "*bf16",
            "ids": "*i32",
            "weights": "*fp32",
        }
        | scales
        | ints
        | {"stride_x": "i32", "stride_l": "i32", "stride_g": "i32"},
        {
            "E": 256,
            "BLOCK_E": 256,
            "TOP_K": 8,
            "NORM": norm,
            "FP8": fp8,
            "GROUP": 128,
            "BLOCK_N": gate_up_tile.block_n,
            "BLOCK_K": gate_up_tile.block_k,
        },
        gate_up_tile.num_warps,
    )
    down = compile_for_sm90(
        triton_moe_pairs._down_combine,
        {
            "inter": "*bf16",
            "w2": w,
            "sw2": w,
            "w2_s": "*fp32",
            "sw2_s": "*fp32",
            "ids": "*i32",
            "weights": "*fp32",
            "out": "*bf16",
        }
        | {k: v for k, v in ints.items() if k not in ("first", "local")},
        {"TOP_K": 8, "FP8": fp8, "GROUP": 128, "BLOCK_N": down_tile.block_n, "BLOCK_K": down_tile.block_k},
        down_tile.num_warps,
    )
    for k in (gate_up, down):
        assert k.asm["cubin"] and ".target sm_90" in k.asm["ptx"]


def test_fp8_aligned_moe_and_linear_kernels_compile_for_sm90():
    """The e4m3 tensor-core paths of the aligned MoE GEMMs, the GEMV (bf16 and FP8 weights, with and without
    split K, with each prologue; its plain tail is in every variant) and the activation quantization."""
    ints = dict.fromkeys(("H", "I", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_is"), "i32")
    rows = {"block_expert": "*i32", "starts": "*i32", "counts": "*i32", "sorted_pairs": "*i32"}
    gemm = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128}  # FP8 takes the scale group as BLOCK_N and BLOCK_K
    kernels = [
        compile_for_sm90(
            triton_moe_aligned._gate_up_silu,
            {
                "x": "*fp8e4nv",
                "x_s": "*fp32",
                "w13": "*fp8e4nv",
                "w13_s": "*fp32",
                "inter": "*fp8e4nv",
                "inter_s": "*fp32",
                "stride_x": "i32",
                "stride_xs_t": "i32",
                "stride_xs_g": "i32",
            }
            | rows
            | ints,
            {"TOP_K": 8, "FP8": True, "MODEL_DTYPE": triton.language.bfloat16} | gemm,
        ),
        compile_for_sm90(
            triton_moe_aligned._down,
            {
                "inter": "*fp8e4nv",
                "inter_s": "*fp32",
                "w2": "*fp8e4nv",
                "w2_s": "*fp32",
                "out": "*bf16",
                "weights": "*fp32",
            }
            | rows
            | ints,
            {"FP8": True} | gemm,
        ),
        *[
            compile_for_sm90(
                triton_gemv_kernels._gemv,
                {
                    "x": "*bf16",
                    "other": "*bf16",
                    "norm_w": "*bf16",
                    "w": w,
                    "w_scale": "*fp32",
                    "tail": "*bf16",
                    "bias": "*bf16",
                    "out": "*bf16",
                    "partials": "*fp32",
                    "arrivals": "*i32",
                    "normed_out": "*bf16",
                    "residual_out": "*bf16",
                    "eps": "fp32",
                }
                | dict.fromkeys(
                    ("N", "N_TAIL", "K", "stride_xt", "stride_xh", "stride_ot", "stride_oh")
                    + ("stride_wn", "stride_sn", "stride_tn", "stride_om"),
                    "i32",
                ),
                {
                    "FP8": w == "*fp8e4nv",
                    "HAS_BIAS": prologue == triton_gemv.SIGMOID_GATE,
                    "PROLOGUE": prologue,
                    "HEAD": 128,
                    "ROUND_PRODUCT": True,
                    "GROUP": 128,
                    "BLOCK_N": 16,
                    "BLOCK_K": 512,
                    "SPLIT_K": split,
                },
            )
            for w, prologue, split in (
                ("*bf16", triton_gemv.PLAIN, 1),
                ("*bf16", triton_gemv.ADD_NORM, 2),
                ("*fp8e4nv", triton_gemv.GATED_NORM, 4),
                ("*fp8e4nv", triton_gemv.SIGMOID_GATE, 1),
                ("*fp8e4nv", triton_gemv.PLAIN, 4),
            )
        ],
        compile_for_sm90(
            triton_linear._quantize_groups,
            {"x": "*bf16", "q": "*fp8e4nv", "scales": "*fp32"}
            | dict.fromkeys(("M", "K", "stride_xm", "stride_sg"), "i32"),
            {"GROUP": 128, "GROUPS": 4},
        ),
    ]
    for k in kernels:
        assert k.asm["cubin"] and ".target sm_90" in k.asm["ptx"]


def test_aligned_moe_routing_kernels_compile_for_sm90():
    """Routing, scatter and combine of the aligned path, with the expert-parallel bounds."""
    kernels = [
        compile_for_sm90(
            triton_moe_aligned._route,
            {
                "logits": "*bf16",
                "ids": "*i32",
                "weights": "*fp32",
                "ranks": "*i32",
                "counts": "*i32",
                "stride_l": "i32",
                "first": "i32",
                "local": "i32",
            },
            {"E": 256, "BLOCK_E": 256, "TOP_K": 8, "NORM": True},
        ),
        compile_for_sm90(
            triton_moe_aligned._scatter,
            {"ids": "*i32", "ranks": "*i32", "starts": "*i32", "sorted_pairs": "*i32", "P": "i32"},
            {"BLOCK": 256},
        ),
        compile_for_sm90(
            triton_moe_aligned._combine,
            {
                "pairs_out": "*bf16",
                "ids": "*i32",
                "shared": "*bf16",
                "gate": "*bf16",
                "out": "*bf16",
                "H": "i32",
                "stride_s": "i32",
                "stride_g": "i32",
            },
            {"TOP_K": 8, "BLOCK_H": 1024},
        ),
    ]
    for k in kernels:
        assert k.asm["cubin"] and ".target sm_90" in k.asm["ptx"]
