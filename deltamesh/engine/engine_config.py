"""Engine settings, and how the engine turns them into concrete devices, dtypes and pool sizes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltamesh.engine.defaults import DEFAULT_MODEL

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str = str(DEFAULT_MODEL)  # Hugging Face checkpoint directory (config.json is enough for dummy)
    load_format: str = "auto"  # auto | safetensors | dummy
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    state_dtype: str = "float32"  # GDN recurrent state: float32 | bfloat16
    page_size: int = 16
    num_kv_pages: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # None: 1 GiB on CPU, 85% of free memory on CUDA
    max_num_seqs: int = 32  # concurrent requests (= GDN state slots)
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 32768
    max_num_batched_tokens: int = 1024  # token budget of one step (prefill chunk size)
    kernel_backend: str | None = None  # None/auto | torch | flashinfer | fla | "op=backend,..."
    seed: int = 0  # dummy weights and unseeded sampling
    torch_threads: int | None = None  # CPU threads for torch (None: torch's default)
    cuda_graphs: bool = True  # CUDA only: replay decode steps from captured graphs
    async_scheduling: bool = True  # schedule and launch step N+1 before reading step N's tokens on the host
    # Prefix caching (prefix_cache.py). Off by default: cached pages stay allocated after their requests end, and
    # callers (tests, services' idle checks) read any page still in use after the work as a leak.
    prefix_cache: bool = False
    prefix_cache_pages: int | None = None  # most KV pages the cache keeps; None: as many as the pool has free
    prefix_cache_checkpoints: int = 8  # GDN state checkpoint slots (each the size of a request's state slot)
    state_checkpoint_interval: int | None = None  # also checkpoint every this many pages of a prompt (None: only its end)

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        return self.max_model_len or min(max_position_embeddings, 32768)

    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.torch_device().type == "cpu" else torch.bfloat16
        return _dtype(self.dtype)

    def torch_state_dtype(self) -> torch.dtype:
        return _dtype(self.state_dtype)

    def validate(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"state_dtype must be float32 or bfloat16, got {self.state_dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.prefix_cache_checkpoints < 1 or (self.prefix_cache_pages or 0) < 0:
            raise ValueError("prefix_cache_checkpoints must be >= 1 and prefix_cache_pages >= 0")
        if self.state_checkpoint_interval is not None and self.state_checkpoint_interval < 1:
            raise ValueError("state_checkpoint_interval must be >= 1 pages")
        self.torch_dtype()


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}") from None
