"""Kernel launches of one eager decode step with the Triton backend's ops, counted on the CPU (no GPU needed), with
the fused projections off (gpu_common.few_token_fusions(False): every op its own kernel, as before them)
and on. The model is the 35B-A3B shape at small widths (a layer's launches do not depend on its widths; fewer
routed choices per token, which run in the same two kernels), dummy weights, the Triton kernels run by Triton's
CPU interpreter. Steps of 4 and 8 layers are counted (one and two periods of 3 GDN + 1 attention layers), and
the full model's 40 layers from them: the launches outside the layers once, the period's ten times.

What is counted: every Triton kernel launch, and every torch operation that computes (views and allocations
left out) outside them; each counted under the registry op (kernels.*) that issued it, the rest under "(model)".
Two things differ on the GPU: the GDN recurrence is FlashInfer's one kernel there (its torch reference runs here,
so `gdn_decode` is counted as one launch per call), and cuBLAS may add a split-K reduction kernel to a linear
layer (counted here as one launch). The GPU's own count: `launches` of bench/gpu_fusion.py.

    python bench/step_launches.py --out bench/results/step_launches.json
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import argparse
import json
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CONFIGS, RESULTS, decode_items, ints, print_table, write_result
from bench.gpu_common import few_token_fusions
from deltamesh.kernels import registry, triton_backend
from deltamesh.kernels.registry import OPS, Kernels, ModelShapes

# The 35B-A3B shape's layers and kinds of projection at small widths (FP8 needs whole 128-row blocks).
SMALL = {
    "hidden_size": 128,
    "num_experts_per_tok": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 16,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "vocab_size": 1024,
}
COUNTED_AS_ONE = {"gdn_decode": "FlashInfer's decode kernel on the GPU"}


def small_config(model: Path, into: Path, layers: int) -> Path:
    cfg = json.loads((model / "config.json").read_text())
    text = cfg["text_config"]
    text |= SMALL | {"num_hidden_layers": layers, "layer_types": text["layer_types"][:layers]}
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(cfg))
    return into


class Launches(TorchDispatchMode):
    """Counts torch operations that compute (return a tensor of their own, not a view or an allocation), under
    the registry op running (`self.op`)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.op = "(model)"
        self.quiet = 0  # inside a Triton launch or an op counted as one

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        computes = any(str(r.type).startswith("Tensor") and r.alias_info is None for r in schema.returns)
        if not self.quiet and computes and not schema.name.startswith("aten::empty"):
            self.counts[self.op] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def inside(self, op: str, quiet: bool = False):
        outer = self.op
        self.op, self.quiet = op, self.quiet + quiet
        try:
            yield
        finally:
            self.op, self.quiet = outer, self.quiet - quiet


def counting_kernels(kernels: Kernels, launches: Launches) -> Kernels:
    """`kernels` with every op counted under its name (and one launch for the ops COUNTED_AS_ONE)."""

    def wrap(op, fn):
        def counted(*args, **kwargs):
            with launches.inside(op, quiet=op in COUNTED_AS_ONE):
                if op in COUNTED_AS_ONE:
                    launches.counts[op] += 1
                return fn(*args, **kwargs)

        return counted

    return Kernels(**{op: wrap(op, getattr(kernels, op)) for op in OPS}, chosen=kernels.chosen)


@contextmanager
def triton_launches_counted(launches: Launches):
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launches.counts[launches.op] += 1
        with launches.inside(launches.op, quiet=True):
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield
    finally:
        InterpretedFunction.run = run


def triton_ops(core) -> Kernels:
    """The ops the Triton backend gives a CUDA device (its loader only reads the device's type), the torch
    reference for the rest (the GDN recurrence)."""
    m = core.model_config
    shapes = ModelShapes(
        torch.bfloat16,
        torch.float32,
        m.linear_num_key_heads,
        m.linear_num_value_heads,
        m.linear_key_head_dim,
        m.linear_value_head_dim,
        m.num_attention_heads,
        m.num_key_value_heads,
        m.head_dim,
        core.kv_pool.page_size,
    )
    ops, reason = triton_backend._load(torch.device("cuda"), shapes)
    assert not reason, reason
    torch_ops = registry._load_torch(torch.device("cpu"), shapes)[0]
    return Kernels(**(torch_ops | ops), chosen={op: "triton" if op in ops else "torch" for op in OPS})


def step_counts(core, kernels: Kernels, batch: int, context: int) -> Counter:
    launches = Launches()
    items = decode_items(core, batch, context)
    input_ids, step = core.runner.prepare(items)
    model, counted = core.model, counting_kernels(kernels, launches)
    with torch.inference_mode(), triton_launches_counted(launches), launches:
        model.logits(model(input_ids, step, core.kv_pool, core.state_pool, counted))
    for it in items:
        core.scheduler.free(it.request)
    return launches.counts


def counted_model(model: Path, layers: int, batches: list[int], quantization: str) -> dict:
    """{(batch, "off" | "on"): Counter of launches per op} of one decode step of the model cut to `layers`."""
    from deltamesh.engine import EngineConfig
    from deltamesh.engine.core import EngineCore

    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(
            model=str(small_config(model, Path(tmp) / "model", layers)),
            load_format="dummy",
            device="cpu",
            dtype="float32",  # the interpreter's bf16 dots are not the GPU's; counts do not depend on values
            max_num_seqs=max(batches),
            num_kv_pages=max(batches) * 8 + 8,
            max_model_len=64,
            prefix_cache=False,
            quantization=quantization,
        )
        core = EngineCore(config)
    kernels, counts = triton_ops(core), {}
    for batch in batches:
        for fused in ("off", "on"):
            with few_token_fusions(fused == "on"):
                counts[batch, fused] = step_counts(core, kernels, batch, context=40)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(CONFIGS / "qwen3.5-35b-a3b"))
    p.add_argument("--batches", type=ints, default=[1])
    p.add_argument("--quantization", choices=["none", "fp8"], default="none")
    p.add_argument("--out", default=str(RESULTS / "step_launches.json"))
    args = p.parse_args()
    text = json.loads((Path(args.model) / "config.json").read_text())["text_config"]
    period = text["full_attention_interval"]
    periods = text["num_hidden_layers"] // period
    one, two = (counted_model(Path(args.model), n * period, args.batches, args.quantization) for n in (1, 2))
    rows = []
    for batch in args.batches:
        totals = {}
        for fused in ("off", "on"):
            a, b = one[batch, fused], two[batch, fused]
            # b - a: one period's launches; a minus that: those outside the layers
            totals[fused] = {op: a[op] + (periods - 1) * (b[op] - a[op]) for op in set(a) | set(b)}
        for op in sorted(set(totals["off"]) | set(totals["on"])):
            rows.append({"batch": batch, "op": op, "off": totals["off"].get(op, 0), "on": totals["on"].get(op, 0)})
        rows.append({"batch": batch, "op": "total"} | {f: sum(totals[f].values()) for f in ("off", "on")})
    print(f"launches per decode step of {text['num_hidden_layers']} layers ({args.quantization}):")
    print_table(rows, ["batch", "op", "off", "on"])
    write_result(args.out, {"quantization": args.quantization, "counted_as_one": COUNTED_AS_ONE, "rows": rows})


if __name__ == "__main__":
    main()
