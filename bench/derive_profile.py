"""A planner profile DERIVED, not measured: a profile measured on one GPU for one Qwen3.5 MoE shape, scaled to
another shape, weight precision and tensor-parallel size by what each step must move and compute. It sizes layouts
that no host here can run (the recipe's Qwen3.5-397B-A17B FP8 on H200 nodes, issue #50); every number it writes is
a prediction, and the profile's provenance lists the assumptions:

- a decode step costs a fixed time per layer (its kernels' launches and small kernels, which more GPUs do not
  shorten) plus the bytes one GPU reads in it (its share of the weights of the layers and of the experts the
  batch touches, its KV heads, its GDN state read and written) at an effective bandwidth: both fitted to the
  source's decode steps (least squares; the fit's error on each source point is kept); plus two all-reduces per
  layer across the worker's GPUs (`--allreduce-us` each, plus the bytes at `--allreduce-gbps`);
- prompt tokens cost the source's time per token times the ratio of matmul FLOPs per token on one GPU, divided by
  `--fp8-speedup` for FP8 weights from bf16 ones (1.23: the engine's own FP8 against bf16 projections at 4,096
  tokens, bench/RESULTS.md), plus the all-reduces of the step's tokens; a step's fixed time scales with the layers;
- a state moves between workers at `--transfer-gbps` per GPU, each GPU pulling its part;
- memory: the weights split over the GPUs, one KV head per GPU where the model has fewer KV heads than GPUs
  (replicated, as vLLM and SGLang do), the pools in `--gpu-memory-gib` less the weights.

    python bench/derive_profile.py --source bench/profiles/h200-qwen3.5-35b-a3b-from-results.json \\
        --target bench/configs/qwen3.5-397b-a17b --fp8 --tensor-parallel-size 8 \\
        --out bench/profiles/h200x8-qwen3.5-397b-a17b-fp8-derived.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT
from deltamesh.planner.profile import DecodeGrid, MemoryModel, PrefillModel, Profile, TransferModel

KV_BYTES = 2  # bf16 KV cache
STATE_BYTES = 4  # fp32 GDN recurrent state
CONV_BYTES = 2  # bf16 conv state


@dataclass(frozen=True)
class Worker:
    """One worker's model shape (a Qwen3.5 MoE text config), weight bytes per parameter and GPUs."""

    cfg: dict
    weight_bytes: float  # 2 bf16, 1 FP8 (block scales: under 0.1 %, left out)
    tp: int

    @classmethod
    def of(cls, model_dir: str, weight_bytes: float, tp: int) -> Worker:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(cfg.get("text_config", cfg), weight_bytes, tp)

    def _get(self, key: str) -> int:
        return int(self.cfg[key])

    @property
    def layers(self) -> tuple[int, int]:
        """(GDN layers, full-attention layers)."""
        n, every = self._get("num_hidden_layers"), self._get("full_attention_interval")
        return n - n // every, n // every

    # ---- parameters of one layer of each kind, and of the whole model -------------------------------------
    def attention_params(self) -> int:
        h, heads, kv, hd = (
            self._get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        )
        return h * heads * hd * 2 + 2 * h * kv * hd + heads * hd * h  # gated q, k, v, o

    def gdn_params(self) -> int:
        h = self._get("hidden_size")
        kh, vh = self._get("linear_num_key_heads"), self._get("linear_num_value_heads")
        kd, vd = self._get("linear_key_head_dim"), self._get("linear_value_head_dim")
        return h * (2 * kh * kd + 2 * vh * vd) + h * 2 * vh + vh * vd * h  # qkvz, ba, out

    def expert_params(self) -> int:
        return 3 * self._get("hidden_size") * self._get("moe_intermediate_size")

    def shared_params(self) -> int:
        h = self._get("hidden_size")
        return 3 * h * self._get("shared_expert_intermediate_size") + h  # the shared expert and its gate

    def params(self) -> int:
        gdn, full = self.layers
        h, vocab, n = self._get("hidden_size"), self._get("vocab_size"), self._get("num_experts")
        per_layer = self.shared_params() + h * n + n * self.expert_params()
        return gdn * self.gdn_params() + full * self.attention_params() + (gdn + full) * per_layer + 2 * vocab * h

    # ---- one GPU's share of a step ---------------------------------------------------------------------------
    def experts_touched(self, tokens: int) -> float:
        """Distinct experts `tokens` tokens route to, in expectation under uniform routing."""
        n, k = self._get("num_experts"), self._get("num_experts_per_tok")
        return n * (1 - (1 - k / n) ** tokens)

    def decode_bytes(self, batch: int, context: float) -> float:
        """Bytes one GPU reads (and, for GDN state, writes) in a decode step: its share of the layers' weights
        (the router and the LM head in bf16) and of the experts the batch touches, its KV heads over the
        context, its GDN heads' state."""
        gdn, full = self.layers
        h, vocab, n = self._get("hidden_size"), self._get("vocab_size"), self._get("num_experts")
        dense = gdn * self.gdn_params() + full * self.attention_params() + (gdn + full) * self.shared_params()
        experts = (gdn + full) * self.experts_touched(batch) * self.expert_params()
        weights = (dense + experts) * self.weight_bytes / self.tp + ((gdn + full) * h * n + vocab * h) * 2 / self.tp
        kv_heads = max(1.0, self._get("num_key_value_heads") / self.tp)
        kv = full * batch * context * 2 * kv_heads * self._get("head_dim") * KV_BYTES
        return weights + kv + 2 * batch * self.state_bytes()

    def state_bytes(self) -> float:
        """One request's GDN state on one GPU (conv + recurrent)."""
        gdn, _ = self.layers
        kh, vh = self._get("linear_num_key_heads"), self._get("linear_num_value_heads")
        kd, vd = self._get("linear_key_head_dim"), self._get("linear_value_head_dim")
        width = int(self.cfg.get("linear_conv_kernel_dim", 4)) - 1
        conv = (2 * kh * kd + vh * vd) * width * CONV_BYTES
        return gdn * (vh * kd * vd * STATE_BYTES + conv) / self.tp

    def kv_bytes_per_token(self) -> float:
        _, full = self.layers
        return full * 2 * max(1.0, self._get("num_key_value_heads") / self.tp) * self._get("head_dim") * KV_BYTES

    def flops_per_token(self) -> float:
        """Matmul FLOPs of one prompt token on one GPU (attention's token pairs apart)."""
        gdn, full = self.layers
        k = self._get("num_experts_per_tok")
        active = gdn * self.gdn_params() + full * self.attention_params()
        active += (gdn + full) * (self.shared_params() + k * self.expert_params())
        return 2 * active / self.tp

    def allreduce_ms(self, tokens: int, latency_us: float, gbps: float) -> float:
        """Two all-reduces a layer of `tokens` x hidden bf16 activations (ring: 2 (n-1)/n of them cross)."""
        if self.tp == 1:
            return 0.0
        gdn, full = self.layers
        volume = tokens * self._get("hidden_size") * 2 * 2 * (self.tp - 1) / self.tp
        return 2 * (gdn + full) * (latency_us / 1e3 + volume / (gbps * 1e9) * 1e3)


def fit_decode(source: Profile, src: Worker) -> tuple[float, float, list[float]]:
    """ms = per_layer_ms * layers + ms_per_gb * GB read, least squares over the source's decode points (both
    coefficients non-negative): (per_layer_ms, ms_per_gb, the fit's relative error at each point)."""
    rows = [(sum(src.layers), src.decode_bytes(int(b), ctx) / 1e9, ms) for b, ctx, ms in source.decode.points]
    sxx = sum(g * g for _, g, _ in rows)
    sx, n = sum(g for _, g, _ in rows), len(rows)
    sy, sxy = sum(ms for _, _, ms in rows), sum(g * ms for _, g, ms in rows)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx) if n > 1 else 0.0
    slope = max(slope, 0.0)
    fixed = max((sy - slope * sx) / n, 0.0)
    per_layer = fixed / sum(src.layers)
    errors = [(fixed + slope * g) / ms - 1 for _, g, ms in rows]
    return per_layer, slope, errors


def derive(source: Profile, src: Worker, dst: Worker, args) -> Profile:
    def comm(tokens: int) -> float:
        return dst.allreduce_ms(tokens, args.allreduce_us, args.allreduce_gbps)

    per_layer_ms, ms_per_gb, errors = fit_decode(source, src)
    layers = sum(dst.layers) / sum(src.layers)
    points = [
        [b, ctx, per_layer_ms * sum(dst.layers) + ms_per_gb * dst.decode_bytes(int(b), ctx) / 1e9 + comm(int(b))]
        for b, ctx, _ in source.decode.points
    ]
    speedup = args.fp8_speedup if dst.weight_bytes < src.weight_bytes else 1.0
    flops = dst.flops_per_token() / src.flops_per_token() / speedup
    _, src_full = src.layers
    _, dst_full = dst.layers
    heads = dst._get("num_attention_heads") / dst.tp / src._get("num_attention_heads")
    comm_per_token = (comm(args.allreduce_tokens) - comm(0)) / args.allreduce_tokens  # the bytes' part
    prefill = PrefillModel(
        source.prefill.step_ms * layers + comm(0),
        source.prefill.ms_per_token * flops + comm_per_token,
        source.prefill.ms_per_mpair * heads * dst_full / src_full,
    )
    state, kv_token = dst.state_bytes(), dst.kv_bytes_per_token()
    weights = dst.params() * dst.weight_bytes / dst.tp
    lengths = [1024, 8192, 32768]
    transfer = [[t, (t * kv_token + state) / (args.transfer_gbps * 1e9) * 1e3] for t in lengths]
    name = f"{Path(args.target).name}-{'fp8' if args.fp8 else 'bf16'}-tp{dst.tp}-derived"
    assumptions = {k: v for k, v in vars(args).items() if k not in ("out",)}
    return Profile(
        name=name,
        gpus_per_worker=dst.tp,
        parallelism={"tensor_parallel_size": dst.tp, "data_parallel_size": 1, "enable_expert_parallel": True},
        model={"path": args.target, "name": Path(args.target).name, "family": "qwen3_5_moe", "params": dst.params()},
        engine={**source.engine, "quantization": "fp8" if args.fp8 else "auto"},
        memory=MemoryModel(
            page_size=source.memory.page_size,
            kv_bytes_per_token=int(kv_token),
            state_bytes=int(state),
            weights_bytes=int(weights),
            free_after_weights_bytes=int(args.gpu_memory_gib * 2**30 * args.gpu_memory_utilization - weights),
            prefix_cache=source.memory.prefix_cache,
        ),
        prefill=prefill,
        decode=DecodeGrid(points),
        mixed_extra_ms=source.mixed_extra_ms * layers,
        transfer=TransferModel(transfer, f"derived: the state's bytes on one GPU at {args.transfer_gbps} GB/s"),
        fit_errors={"source_decode": errors},
        provenance={
            "machine": source.provenance.get("machine", {}),
            "derived_from": source.name,
            "decode_fit": {"ms_per_layer": per_layer_ms, "ms_per_gb": ms_per_gb},
            "about": __doc__.split("\n\n")[0].replace("\n", " "),
            "assumptions": assumptions,
            "command": " ".join(sys.argv),
        },
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="a measured profile of a Qwen3.5 MoE shape on one GPU")
    p.add_argument("--target", required=True, help="the model folder (config.json) to derive for")
    p.add_argument("--fp8", action="store_true", help="the target's weights in FP8 (the source's in bf16)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--fp8-speedup", type=float, default=1.23, help="bf16 / FP8 time of the prefill matmuls")
    p.add_argument("--allreduce-us", type=float, default=20.0, help="one small all-reduce across the GPUs, µs")
    p.add_argument("--allreduce-gbps", type=float, default=360.0, help="all-reduce bus bandwidth, GB/s")
    p.add_argument("--allreduce-tokens", type=int, default=8192, help="tokens at which the per-token cost is taken")
    p.add_argument("--transfer-gbps", type=float, default=40.0, help="state pull rate per GPU, GB/s")
    p.add_argument("--gpu-memory-gib", type=float, default=139.8, help="one GPU's memory (an H200's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    source = Profile.load(args.source)
    src = Worker.of(str(ROOT / source.model["path"]), 2.0, source.gpus_per_worker)
    dst = Worker.of(args.target, 1.0 if args.fp8 else 2.0, args.tensor_parallel_size)
    profile = derive(source, src, dst, args)
    if profile.memory.free_after_weights_bytes <= 0:
        raise SystemExit(
            f"{profile.name}: {profile.memory.weights_bytes / 2**30:.0f} GiB of weights per GPU do not fit"
        )
    profile.save(args.out)
    rows = [(int(b), int(c), round(ms, 2)) for b, c, ms in profile.decode.points]
    print(
        f"{profile.name}: {dst.params() / 1e9:.1f}B params, {profile.memory.weights_bytes / 2**30:.1f} GiB weights per GPU"
    )
    fit = profile.provenance["decode_fit"]
    print(
        f"decode fit on the source: {fit['ms_per_layer'] * 1e3:.1f} us a layer + {fit['ms_per_gb']:.3f} ms a GB"
        f" ({1 / fit['ms_per_gb']:.2f} TB/s); errors {[f'{e:+.0%}' for e in profile.fit_errors['source_decode']]}"
    )
    print(f"decode [batch, context, ms]: {rows}")
    print(f"prefill: {profile.prefill}; 8k prompt alone {profile.prefill.ms(8192, 8192**2 / 2):.0f} ms")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
