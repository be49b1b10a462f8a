"""Build a model and fill its weights: from a Hugging Face checkpoint directory, or seeded random
weights at the real shapes (`load_format="dummy"`). A model whose config carries an FP8 quantization_config
keeps its quantized layers in FP8 where the kernels take them (`fp8_weights`; elsewhere they are dequantized on
load); dummy FP8 weights are random values quantized in blocks as the checkpoints are."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from tqdm import tqdm

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.models import MODEL_CLASSES, HybridLM
from deltamesh.engine.parallel import TensorParallelGroup, reads_tensor, shard_part, shard_scales, shard_tensor
from deltamesh.engine.quantization import SCALE_SUFFIX, dequantized
from deltamesh.kernels.fp8 import BLOCK, quantize_blocks

log = structlog.get_logger("deltamesh.weights")

# Parts of released checkpoints that a text-only server does not use.
_IGNORED_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."  # the multi-token-prediction module (models/mtp.py), read only by a model that drafts with it


class WeightError(ValueError):
    """The checkpoint's tensors do not fit the configured model."""


def build_model(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallelGroup | None = None,
    fp8: bool = False,
    mtp: bool = False,
) -> HybridLM:
    """`mtp`: with the checkpoint's MTP module (WeightError when its config declares none)."""
    if mtp and cfg.mtp_layers < 1:
        raise WeightError(
            "speculative decoding drafts with the checkpoint's MTP module, but its config.json declares none "
            "(mtp_num_hidden_layers / num_nextn_predict_layers)"
        )
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = MODEL_CLASSES[cfg.family](cfg, device, tp, fp8, mtp)
        finally:
            torch.set_default_dtype(prev)
    return model.eval()


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{model_dir}: no *.safetensors files")
    return files


def iter_checkpoint(
    model_dir: Path, wanted: Callable[[str], bool] = lambda name: True, read: Callable | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor `wanted` names; the others are not read. `read(file, name)`: how a tensor
    is read from its open safetensors file (default: whole)."""
    files = checkpoint_files(model_dir)
    # a progress bar over the shards of a real checkpoint, on a terminal only (logs stay JSON lines)
    shown = len(files) > 1 and sys.stderr.isatty()
    for path in tqdm(files, desc="loading checkpoint shards", unit="shard", disable=not shown):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    yield name, read(f, name) if read else f.get_tensor(name)


def canonical_name(name: str) -> str | None:
    """Map a checkpoint tensor name to the text model's naming, or None for parts we do not serve."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    if name.startswith("model.mtp."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def fp8_weights(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallelGroup | None,
    quantization: str = "auto",
) -> bool:
    """Whether the projections hold FP8 values and block scales (the kernels compute as kernels/fp8.py says) or
    the model dtype. "none": never (an FP8 checkpoint is dequantized on load). "fp8": always, an FP8 checkpoint's
    values kept, a bf16 one's quantized on load; refused where the model does not allow it. "auto": an FP8
    checkpoint on the GPU in bf16/fp16, where the model allows; elsewhere dequantized."""
    if quantization == "none":
        return False
    why_not = _fp8_layout_unsupported(cfg, tp)
    if quantization == "fp8":
        if why_not:
            raise WeightError(f"quantization fp8: {why_not}")
        return True
    if cfg.fp8_block is None:
        return False
    if device.type != "cuda":
        why_not = "the CPU engine computes with the dequantized weights (--quantization fp8 keeps them)"
    elif dtype not in (torch.bfloat16, torch.float16):
        why_not = why_not or f"a {dtype} model computes with the dequantized weights"
    log.info("FP8 checkpoint", fp8_weights=why_not is None, dequantized_because=why_not)
    return why_not is None


def _fp8_layout_unsupported(full: ModelConfig, tp: TensorParallelGroup | None) -> str | None:
    """Why this rank's projections cannot hold FP8 blocks whole (None: they can)."""
    cfg = tp.shard.local if tp else full
    if cfg.fp8_block not in (None, (BLOCK, BLOCK)):
        return f"the FP8 kernels take {BLOCK}x{BLOCK} weight blocks, not {cfg.fp8_block}"
    sizes = {
        "hidden_size": cfg.hidden_size,
        "head_dim": cfg.head_dim,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }
    odd = [f"{name} {size}" for name, size in sizes.items() if size and size % BLOCK]
    if odd:
        per_rank = f" per rank of {tp.shard.size}" if tp else ""
        return f"the FP8 kernels need projections in whole {BLOCK}-row blocks, not {', '.join(odd)}{per_rank}"
    return None


class ShardReader:
    """Reads a parallel rank's part of each checkpoint tensor from disk, and no more, where the part can be
    taken as it is stored. Read whole and split after: block scales (small), an FP8 weight that is dequantized
    on load (`keep` says which stay FP8), a tensor the model family regroups on load."""

    def __init__(self, model: HybridLM, keep: Callable[[str], bool]):
        assert model.group is not None, "a parallel rank's model reads its parts"
        self.model, self.shard, self.keep = model, model.group.shard, keep
        self.taken: set[str] = set()  # canonical names read as this rank's part already
        self.elements = 0  # read from disk

    def read(self, f, name: str) -> torch.Tensor:
        stored, canonical = f.get_slice(name), canonical_name(name)
        assert canonical is not None, f"{name}: read only when wanted (load_checkpoint), so a model weight's"
        dequantized_whole = stored.get_dtype().startswith("F8") and not self.keep(name)
        if name.endswith(SCALE_SUFFIX) or dequantized_whole or self.model.regroups(canonical):
            tensor = f.get_tensor(name)
        else:
            part = shard_part(canonical, stored.get_shape(), self.shard)
            assert part is not None, f"{name}: read only when this rank holds part of it (reads_tensor)"
            tensor = part.take(stored)
            self.taken.add(canonical)
        self.elements += tensor.numel()
        return tensor


def load_checkpoint(model: HybridLM, model_dir: Path) -> ShardReader | None:
    """Fill the model from its checkpoint; on a parallel rank, the reader that read its parts."""

    def wanted(name: str) -> bool:
        canonical = canonical_name(name)
        if canonical is None or (model.mtp is None and canonical.startswith(MTP_PREFIX)):
            return False
        return model.group is None or reads_tensor(name, model.group.shard)

    slots = model.weight_slots()
    fp8_names = {name for name, slot in slots.items() if slot.param.dtype == torch.float8_e4m3fn}
    keep = lambda name: canonical_name(name) in fp8_names  # noqa: E731
    reader = ShardReader(model, keep) if model.group else None
    tensors = iter_checkpoint(model_dir, wanted, reader.read if reader else None)
    load_tensors(model, dequantized(tensors, model.cfg.fp8_block, keep), slots, reader.taken if reader else set())
    return reader


def load_tensors(
    model: HybridLM, named_tensors, slots: dict | None = None, taken: Collection[str] = frozenset()
) -> None:
    """Fill every weight from (checkpoint name, tensor) pairs; names the missing and the unexpected. A parallel
    rank keeps its own part of each tensor (parallel.shard_tensor), unless `taken` names it as read so already.
    `slots`: the model's weight_slots, when the caller has them."""
    slots = slots or model.weight_slots()
    covered: dict[int, int] = {}
    params = {id(s.param): s.param for s in slots.values()}
    unexpected = []
    with torch.no_grad():
        for raw_name, tensor in named_tensors:
            name = canonical_name(raw_name)
            if name is None or (model.mtp is None and name.startswith(MTP_PREFIX)):
                continue
            for part_name, part in model.checkpoint_tensors(name, tensor):
                if model.group and part_name not in taken:
                    shard = shard_scales if part_name.endswith(SCALE_SUFFIX) else shard_tensor
                    mine = shard(part_name, part, model.group.shard)
                    if mine is None:  # an expert another rank holds
                        continue
                    part = mine
                slot = slots.get(part_name)
                if slot is None:
                    unexpected.append(part_name)
                    continue
                target = slot.target()
                if tuple(target.shape) != tuple(part.shape):
                    raise WeightError(
                        f"{part_name}: checkpoint shape {tuple(part.shape)}, model expects {tuple(target.shape)}"
                    )
                if target.dtype == torch.float8_e4m3fn and part.dtype != target.dtype:
                    # a layer the checkpoint left unquantized, in an FP8 weight: quantized as the others are
                    part, scales = quantize_blocks(part)
                    _fill(slots[part_name + SCALE_SUFFIX], scales, covered)
                _fill(slot, part, covered)
    if unexpected:
        raise WeightError(f"checkpoint has tensors this model does not use: {unexpected[:8]}")
    missing = [pid for pid, p in params.items() if covered.get(pid, 0) < p.numel()]
    if missing:
        names = sorted({n for n, s in slots.items() if id(s.param) in missing})
        hint = ""
        if all(n.startswith(MTP_PREFIX) for n in names):
            hint = " (the MTP module speculative decoding drafts with: this checkpoint does not ship it)"
        raise WeightError(f"checkpoint lacks weights for: {names[:8]}{' ...' if len(names) > 8 else ''}{hint}")


def _fill(slot, part: torch.Tensor, covered: dict[int, int]) -> None:
    slot.target().copy_(part.to(slot.param.device))
    covered[id(slot.param)] = covered.get(id(slot.param), 0) + part.numel()


def init_dummy(model: HybridLM, seed: int) -> None:
    """Seeded random weights with sensible scales, generated on the model's device; FP8 weights are such
    values quantized in blocks, with their scales."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("_scale"):
                continue  # filled with its FP8 weight
            if p.dtype == torch.float8_e4m3fn:
                _fill_fp8_dummy(p, params[name + "_scale"], gen)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=device).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("mixer.norm.weight"):
                p.fill_(1.0)  # GDN gated norm multiplies by w directly
            elif p.dim() == 1:
                p.normal_(0.0, 0.02, generator=gen)  # zero-centred norms: w near 0 means scale near 1
            else:
                fan_in = p.shape[-1]
                p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)


def _fill_fp8_dummy(weight: torch.Tensor, scale: torch.Tensor, gen: torch.Generator) -> None:
    """Random values with the bf16 dummy's spread, quantized in blocks; an expert at a time bounds the float copy."""
    for w, s in zip(weight, scale) if weight.dim() == 3 else [(weight, scale)]:
        values = torch.empty(w.shape, device=w.device).normal_(0.0, 1.0 / math.sqrt(w.shape[-1]), generator=gen)
        q, scales = quantize_blocks(values)
        w.copy_(q)
        s.copy_(scales)


def load_model(
    cfg: ModelConfig,
    model_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
    tp: TensorParallelGroup | None = None,
    fp8: bool = False,
    mtp: bool = False,
) -> HybridLM:
    """`fp8`: the linear layers in FP8 (`fp8_weights` decides); `mtp`: with the MTP module (build_model)."""
    started = time.monotonic()
    model = build_model(cfg, device, dtype, tp, fp8, mtp)
    if load_format == "dummy":
        # data-parallel ranks hold the same weights outside their MoE layers: the same seed
        init_dummy(model, seed + (tp.shard.rank if tp and not tp.shard.data_parallel else 0))
    elif load_format in ("auto", "safetensors"):
        if model_dir is None:
            raise WeightError("a model directory is needed unless load_format='dummy'")
        load_checkpoint(model, model_dir)
    else:
        raise WeightError(f"unknown load_format {load_format!r} (auto, safetensors, dummy)")
    log.info(
        "model loaded",
        family=cfg.family,
        load_format=load_format,
        device=str(device),
        dtype=str(dtype),
        params=sum(p.numel() for p in model.parameters()),
        seconds=round(time.monotonic() - started, 2),
    )
    return model
