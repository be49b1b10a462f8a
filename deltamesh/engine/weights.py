"""Build a model and fill its weights: from a Hugging Face checkpoint directory, or seeded random
weights at the real shapes (`load_format="dummy"`)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import structlog
import torch
from safetensors import safe_open
from tqdm import tqdm

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.models import MODEL_CLASSES, HybridLM
from deltamesh.engine.parallel import TensorParallelGroup, reads_tensor, shard_tensor
from deltamesh.engine.quantization import dequantized

log = structlog.get_logger("deltamesh.weights")

# Parts of released checkpoints that a text-only server does not use.
_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


class WeightError(ValueError):
    """The checkpoint's tensors do not fit the configured model."""


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                tp: TensorParallelGroup | None = None) -> HybridLM:  # fmt: skip
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = MODEL_CLASSES[cfg.family](cfg, device, tp)
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


def iter_checkpoint(model_dir: Path, wanted: Callable[[str], bool] = lambda name: True,
                    ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """(name, tensor) of every tensor `wanted` names; the others are not read."""
    files = checkpoint_files(model_dir)
    # a progress bar over the shards of a real checkpoint, on a terminal only (logs stay JSON lines)
    shown = len(files) > 1 and sys.stderr.isatty()
    for path in tqdm(files, desc="loading checkpoint shards", unit="shard", disable=not shown):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    yield name, f.get_tensor(name)


def canonical_name(name: str) -> str | None:
    """Map a checkpoint tensor name to the text model's naming, or None for parts we do not serve."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def load_checkpoint(model: HybridLM, model_dir: Path) -> None:
    def wanted(name: str) -> bool:
        return canonical_name(name) is not None and (model.tp is None or reads_tensor(name, model.tp.shard))

    load_tensors(model, dequantized(iter_checkpoint(model_dir, wanted), model.cfg.fp8_block))


def load_tensors(model: HybridLM, named_tensors) -> None:
    """Fill every weight from (checkpoint name, tensor) pairs; names the missing and the unexpected. A
    tensor-parallel rank keeps its own part of each tensor (parallel.shard_tensor)."""
    slots = model.weight_slots()
    covered: dict[int, int] = {}
    params = {id(s.param): s.param for s in slots.values()}
    unexpected = []
    with torch.no_grad():
        for raw_name, tensor in named_tensors:
            name = canonical_name(raw_name)
            if name is None:
                continue
            for part_name, part in model.checkpoint_tensors(name, tensor):
                if model.tp:
                    part = shard_tensor(part_name, part, model.tp.shard)
                    if part is None:  # an expert another rank holds
                        continue
                slot = slots.get(part_name)
                if slot is None:
                    unexpected.append(part_name)
                    continue
                target = slot.target()
                if tuple(target.shape) != tuple(part.shape):
                    raise WeightError(f"{part_name}: checkpoint shape {tuple(part.shape)}, model expects {tuple(target.shape)}")
                target.copy_(part.to(target.device))
                covered[id(slot.param)] = covered.get(id(slot.param), 0) + part.numel()
    if unexpected:
        raise WeightError(f"checkpoint has tensors this model does not use: {unexpected[:8]}")
    missing = [pid for pid, p in params.items() if covered.get(pid, 0) < p.numel()]
    if missing:
        names = sorted({n for n, s in slots.items() if id(s.param) in missing})
        raise WeightError(f"checkpoint lacks weights for: {names[:8]}{' ...' if len(names) > 8 else ''}")


def init_dummy(model: HybridLM, seed: int) -> None:
    """Seeded random weights with sensible scales, generated on the model's device."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=device).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("mixer.norm.weight"):
                p.fill_(1.0)  # GDN gated norm multiplies by w directly
            elif p.dim() == 1:
                p.normal_(0.0, 0.02, generator=gen)  # zero-centred norms: w near 0 means scale near 1
            else:
                fan_in = p.shape[-1]
                p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)


def load_model(
    cfg: ModelConfig,
    model_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
    tp: TensorParallelGroup | None = None,
) -> HybridLM:
    started = time.monotonic()
    model = build_model(cfg, device, dtype, tp)
    if load_format == "dummy":
        init_dummy(model, seed + (tp.shard.rank if tp else 0))
    elif load_format in ("auto", "safetensors"):
        if model_dir is None:
            raise WeightError("a model directory is needed unless load_format='dummy'")
        load_checkpoint(model, model_dir)
    else:
        raise WeightError(f"unknown load_format {load_format!r} (auto, safetensors, dummy)")
    log.info("model loaded", family=cfg.family, load_format=load_format, device=str(device), dtype=str(dtype),
             params=sum(p.numel() for p in model.parameters()), seconds=round(time.monotonic() - started, 2))
    return model
