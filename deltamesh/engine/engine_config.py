"""Engine settings, and how the engine turns them into concrete devices, dtypes and pool sizes.

Each field is also a command-line option of the commands that run an engine (deltamesh/services/common/options.py):
its metadata holds the option's help, and "flag" where the option's name is not the field's, "decls" where the
option also takes other names (vLLM's), or "cli": False for a field with no option. torch is imported where a method
needs it, so that commands reading the fields (`--help`) start without it."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deltamesh.engine.defaults import DEFAULT_MODEL
from deltamesh.engine.spec.settings import (
    DEFAULT_DISABLE_BATCH_SIZE,
    DRAFT_VOCAB_HELP,
    check_draft_vocab,
    check_tokens,
    parse_speculative_config,
)

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16", "float16")


@functools.cache
def _bf16_checkpoint_on_a_bf16_cpu(model: str) -> bool:
    """What --dtype auto keeps on the CPU: a bf16 checkpoint stays bf16 where the CPU has native bf16 (AVX512-BF16,
    AMX: torch runs it through oneDNN's bf16 kernels, the faster ones there, bench/RESULTS.md "Engine"), as vLLM's
    CPU backend keeps it; elsewhere bf16 would be emulated, and float32 is kept. Cached: a worker asks for its dtype
    at several places of its start, and the checkpoint's config is read once."""
    import torch

    from deltamesh.engine.config import ConfigError, ModelConfig

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        return ModelConfig.from_dir(model).torch_dtype == "bfloat16"
    except (ConfigError, OSError, ValueError, KeyError):
        return False  # not a checkpoint: loading says why


def _setting(default, help: str = "", **cli):
    """A field with its command-line option's help (and "flag", "decls" or "cli", see the module's docstring)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    # Hugging Face checkpoint directory (config.json is enough for dummy)
    model: str = _setting(str(DEFAULT_MODEL), "Hugging Face checkpoint directory (default: the embedded model)")
    load_format: str = _setting("auto", "auto | safetensors | dummy (random weights at the real shapes)")
    device: str = _setting("cpu", "cpu | cuda | cuda:N")
    dtype: str = _setting("auto", "auto | float32 | bfloat16 (auto: bf16 on CUDA; on CPU: docs/serving.md, Precision)")
    state_dtype: str = _setting("float32", "GDN recurrent state dtype: float32 | bfloat16")
    # weights.fp8_weights says what each choice does where
    quantization: str = _setting(
        "auto",
        "auto (an FP8 checkpoint's weights stay FP8 on the GPU) | fp8 (FP8 "
        "weights; a bf16 checkpoint quantized on load) | none (dequantize)",
    )
    # --block-size: vLLM's name for it (a KV cache block's tokens)
    page_size: int = _setting(16, "KV page size in tokens", decls=("--page-size", "--block-size"))
    # None: sized from memory (memory_budget.py says how)
    num_kv_pages: int | None = _setting(None, "KV pages per worker (default: sized from memory)")
    kv_cache_memory_gb: float | None = _setting(
        None,
        "GiB of KV cache per GPU (default: what --gpu-memory-utilization leaves, else 85 % of the GPU memory free "
        "when the pool is made; 1 GiB on CPU)",
    )
    # vLLM's --gpu-memory-utilization: this worker's share of each of its GPUs, weights included
    gpu_memory_utilization: float | None = _setting(
        None,
        "CUDA: the fraction of each GPU's total memory this worker may use, weights included (workers sharing a GPU "
        "each take their own); its KV cache gets what the weights, state pools and runtime leave",
    )
    max_num_seqs: int = _setting(32, "Concurrent requests per worker (= GDN state slots)")
    # None: the model's max_position_embeddings, capped at 32768
    max_model_len: int | None = _setting(None, "Context length (default: the model's, capped at 32768)")
    # how much prefill one step carries beside its decodes; None: 1024 on CPU, 4096 on CUDA (bench/RESULTS.md:
    # on the H200 4096 gave the lowest TTFT at 8k prompts with TPOT and throughput within a few % of 16384's)
    max_num_batched_tokens: int | None = _setting(
        None, "Token budget of one engine step (default: 1024 on CPU, 4096 on CUDA)"
    )
    # None/auto | torch | flashinfer | fla | "op=backend,..."
    kernel_backend: str | None = _setting(
        None, "Kernel backend: auto | torch | triton | flashinfer | fla | op=backend,...", flag="kernels"
    )
    # one engine over this many ranks (processes; GPUs on CUDA), each holding 1/N of the heads and columns
    tensor_parallel_size: int = _setting(
        1, "Ranks (GPUs on CUDA) one worker's model is split over by heads and columns"
    )
    enable_expert_parallel: bool = _setting(
        False,
        "With --tensor-parallel-size or --data-parallel-size N: split "
        "the routed experts whole among the ranks (not each expert's "
        "columns)",
    )
    # data-parallel attention (engine/data_parallel.py): N ranks, each with its own requests and a whole copy of
    # everything but the MoE layers, whose experts the ranks share
    data_parallel_size: int = _setting(
        1,
        "Ranks (GPUs on CUDA) that each run their own requests through "
        "attention and GDN and share the MoE layers' experts",
    )
    # where a parallel worker's held and arriving states wait on rank 0 (tp_handoff.HandoffArea); on CUDA its
    # memory is left free when the KV pool is sized
    handoff_states: int | None = _setting(
        None,
        "Workers over several ranks: states held or arriving at once, each "
        "waiting on rank 0 (default: --max-num-seqs on CPU, 4 on CUDA)",
    )
    # "module:function" a parallel engine's other ranks call once with their pools (1-D byte views), for a
    # transport to read held states where they are (bytes for the leader's holder); set by a prefill worker from
    # its transport. None (an engine without one, as in-process tests build): held states leave a parallel
    # engine through its hand-off area on rank 0
    rank_exporter: str | None = _setting(None, cli=False)
    # vLLM's --seed: the random state of requests without a seed of their own (reproducible across restarts), and
    # of dummy weights (so workers of one mesh must share it: handoff.compat_hash counts it for them)
    seed: int = _setting(0, "Seed of the sampling of requests that give none (and of dummy weights)")
    torch_threads: int | None = _setting(None, "torch CPU threads per worker")  # None: torch's default
    # off: every step eager (decode and piecewise graphs alike), as vLLM's --enforce-eager asks
    cuda_graphs: bool = _setting(
        True,
        "CUDA only: replay steps from captured CUDA graphs (off, or vLLM's --enforce-eager: every step runs eagerly)",
        decls=("--cuda-graphs/--no-cuda-graphs", " /--enforce-eager"),
    )
    # steps with prompt tokens: cuda_graphs.PiecewiseGraphs. Past 4096 tokens a step's GPU time covers its eager
    # launches (which async scheduling overlaps with the step before), so the default stops there.
    piecewise_cuda_graph_max_tokens: int | None = _setting(
        None,
        "CUDA only: replay steps that carry prompt tokens, "
        "up to this many tokens, from CUDA graphs piece by "
        "piece (0: run them eagerly; default: 4096 or the "
        "step's token budget if smaller)",
    )
    # the engine's periodic "engine steps" line (step_report.py); the Prometheus series do not depend on it
    log_stats: bool = _setting(
        True,
        "Log the engine's steps, throughput and pools every 10 s (vLLM's --disable-log-stats turns it off)",
        decls=("--log-stats/--disable-log-stats",),
    )
    # schedule and launch step N+1 before reading step N's tokens on the host
    async_scheduling: bool = _setting(
        True,
        "Schedule and launch each engine step before the previous step's tokens "
        "reach the host (off: finish every step first)",
    )
    # Prefix caching (prefix_cache.py), also under vLLM's flag names. On, as in the peers; its cost where nothing is
    # reused (a new prompt's prefill stops where its state is checkpointed, and checkpoints take state slots) against
    # its gain on chats is in bench/RESULTS.md.
    prefix_cache: bool = _setting(
        True,
        "Reuse the KV pages and GDN state of prompt prefixes computed before (exact: same tokens as without it)",
        decls=("--prefix-cache/--no-prefix-cache", "--enable-prefix-caching/--no-enable-prefix-caching"),
    )
    prefix_cache_pages: int | None = _setting(None, "Most KV pages the prefix cache keeps (default: every free page)")
    prefix_cache_checkpoints: int | None = _setting(
        None,
        "GDN state checkpoints the prefix cache keeps (each the "
        "size of one request's state; default: twice "
        "--max-num-seqs)",
    )
    state_checkpoint_interval: int | None = _setting(
        None, "Also checkpoint GDN state every this many KV pages of a prompt (default: only at its end)"
    )
    # One budget for both kinds (prefix_cache.py `num_bytes`); the page and checkpoint counts above apply beside it.
    # Every page the cache holds counts, shared with a running request or not, so the bound still holds when those
    # requests finish and the pages are the cache's alone.
    prefix_cache_memory_gb: float | None = _setting(
        None,
        "GiB of KV pages and GDN checkpoints together that the prefix cache keeps, per GPU (default: no joint limit)",
        flag="prefix_cache_memory",
    )

    # speculative decoding with the checkpoint's MTP module (engine/spec/)
    speculative_tokens: int = _setting(
        0,
        "Speculative decoding: tokens the checkpoint's MTP module drafts per step, verified in the next (0: off, 1-4)",
    )
    speculative_config: str | None = _setting(
        None,
        'vLLM\'s form of --speculative-tokens: \'{"method": "mtp", "num_speculative_tokens": K}\' '
        '(disable_by_batch_size too, and "draft_vocab": --speculative-draft-vocab\'s value)',
    )
    # a count N or a token map's path (spec/settings.check_draft_vocab); None: the whole vocabulary
    speculative_draft_vocab: str | None = _setting(None, DRAFT_VOCAB_HELP)
    speculative_disable_batch_size: int | None = _setting(
        None,
        "Speculative decoding: steps with more decoding requests than this run without drafts (default: "
        f"{DEFAULT_DISABLE_BATCH_SIZE}, the largest batch at which MTP was measured to pay on the H200: bench/RESULTS.md)",
    )

    def resolved_prefix_cache_checkpoints(self, slot_bytes: int, page_bytes: int, pool_pages: int) -> int:
        """A prompt's checkpoint and a finished conversation's for every request that can run at once: a
        conversation whose state was evicted computes its whole history again. Under a memory budget, as many as
        it can hold instead: each checkpoint comes with a page of its own in the cache (its block's, or its tail's),
        so at most budget // (slot + page) of them, and no more than the pages the cache can hold (`pool_pages`:
        the most the KV pool can have). The slots are allocated up front: more would be memory never used."""
        budget = self.prefix_cache_memory_bytes()
        if self.prefix_cache_checkpoints or budget is None:
            return self.prefix_cache_checkpoints or 2 * self.max_num_seqs
        most_pages = pool_pages if self.prefix_cache_pages is None else min(pool_pages, self.prefix_cache_pages)
        return min(budget // (slot_bytes + page_bytes), most_pages)

    def prefix_cache_memory_bytes(self) -> int | None:
        return None if self.prefix_cache_memory_gb is None else int(self.prefix_cache_memory_gb * 2**30)

    @property
    def num_ranks(self) -> int:
        """Processes (GPUs on CUDA) one engine runs on."""
        return self.tensor_parallel_size * self.data_parallel_size

    def resolved_handoff_states(self) -> int:
        if self.handoff_states is not None:
            return self.handoff_states
        return self.max_num_seqs if self.device == "cpu" else 4

    def resolved_piecewise_max_tokens(self) -> int:
        limit = self.piecewise_cuda_graph_max_tokens
        return min(4096 if limit is None else limit, self.resolved_max_num_batched_tokens())

    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        # CUDA: vLLM's budget (against 4096: bench/RESULTS.md, "Step budget 4096 or 8192")
        return 1024 if self.device == "cpu" else 8192

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        return self.max_model_len or min(max_position_embeddings, 32768)

    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return _dtype(self.dtype)
        cpu = self.torch_device().type == "cpu"
        return torch.float32 if cpu and not _bf16_checkpoint_on_a_bf16_cpu(self.model) else torch.bfloat16

    def torch_state_dtype(self) -> torch.dtype:
        return _dtype(self.state_dtype)

    def validate(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.handoff_states is not None and self.handoff_states < 1:
            raise ValueError(f"handoff_states must be >= 1, got {self.handoff_states}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(
                "data_parallel_size and tensor_parallel_size cannot both be above 1 (data-parallel "
                "attention runs one rank per request)"
            )
        if self.max_num_seqs < 1 or (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1):
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"state_dtype must be float32 or bfloat16, got {self.state_dtype!r}")
        if self.quantization not in ("auto", "fp8", "none"):
            raise ValueError(f"quantization must be auto, fp8 or none, got {self.quantization!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if (self.prefix_cache_checkpoints is not None and self.prefix_cache_checkpoints < 1) or (
            self.prefix_cache_pages or 0
        ) < 0:
            raise ValueError("prefix_cache_checkpoints must be >= 1 and prefix_cache_pages >= 0")
        if self.kv_cache_memory_gb is not None and not 0 < self.kv_cache_memory_gb < math.inf:
            raise ValueError(
                f"kv_cache_memory_gb (--kv-cache-memory-gb) must be a positive number of GiB, got "
                f"{self.kv_cache_memory_gb}"
            )
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(
                    f"gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], a fraction of the GPU's "
                    f"memory, got {self.gpu_memory_utilization}"
                )
            if self.torch_device().type != "cuda":
                raise ValueError(
                    "gpu_memory_utilization (--gpu-memory-utilization) is a fraction of a GPU's memory: on the CPU, "
                    "bound the KV cache with kv_cache_memory_gb (--kv-cache-memory-gb) instead"
                )
        if self.prefix_cache_memory_gb is not None and not 0 < self.prefix_cache_memory_gb < math.inf:
            raise ValueError(
                f"prefix_cache_memory_gb (--prefix-cache-memory) must be a positive number of GiB, "
                f"got {self.prefix_cache_memory_gb}"
            )
        if (self.piecewise_cuda_graph_max_tokens or 0) < 0:
            raise ValueError("piecewise_cuda_graph_max_tokens must be >= 0")
        if self.state_checkpoint_interval is not None and self.state_checkpoint_interval < 1:
            raise ValueError("state_checkpoint_interval must be >= 1 pages")
        self.resolve_speculative()
        _check_device(self.device)
        self.torch_dtype()

    def resolve_speculative(self) -> None:
        """--speculative-config (vLLM's form) into speculative_tokens / speculative_disable_batch_size, checked."""
        check_tokens(self.speculative_tokens)
        if self.speculative_config:
            k, disable, draft_vocab = parse_speculative_config(self.speculative_config)
            if self.speculative_tokens not in (0, k):
                raise ValueError(
                    f"speculative_tokens {self.speculative_tokens} and speculative_config's num_speculative_tokens "
                    f"{k} disagree (give one of them)"
                )
            self.speculative_tokens = k
            if disable is not None:
                self.speculative_disable_batch_size = disable
            if draft_vocab is not None:
                if self.speculative_draft_vocab not in (None, draft_vocab):
                    raise ValueError(
                        f"speculative_draft_vocab {self.speculative_draft_vocab!r} and speculative_config's "
                        f"draft_vocab {draft_vocab!r} disagree (give one of them)"
                    )
                self.speculative_draft_vocab = draft_vocab
        if self.speculative_draft_vocab is not None:
            self.resolve_draft_vocab()
        if self.speculative_disable_batch_size is not None and self.speculative_disable_batch_size < 1:
            raise ValueError("speculative_disable_batch_size must be >= 1")
        if self.speculative_tokens and self.data_parallel_size > 1:
            raise ValueError("speculative decoding is not supported with data-parallel attention yet")

    def resolve_draft_vocab(self) -> None:
        """--speculative-draft-vocab checked: its form now, its ids against the model's vocabulary where the model's
        config.json is on this machine (the engine checks them again when it builds its draft head)."""
        self.speculative_draft_vocab = check_draft_vocab(self.speculative_draft_vocab)
        if not self.speculative_tokens:
            raise ValueError(
                "speculative_draft_vocab is the vocabulary of speculative decoding's drafts: it needs "
                "speculative_tokens (--speculative-tokens K) >= 1"
            )
        if (Path(self.model) / "config.json").is_file():
            from deltamesh.engine.config import ModelConfig
            from deltamesh.engine.spec.draft_vocab import draft_vocab_ids

            draft_vocab_ids(self.speculative_draft_vocab, ModelConfig.from_dir(Path(self.model)).vocab_size)

    def resolved_spec_disable_batch_size(self) -> int:
        if self.speculative_disable_batch_size is not None:
            return self.speculative_disable_batch_size
        return DEFAULT_DISABLE_BATCH_SIZE


def _check_device(device: str) -> None:
    """`device` exists on this machine: a clear error now rather than torch's, deep in model loading."""
    import torch

    try:
        found = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r}: {e}") from None
    if found.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r}: torch {torch.__version__} finds no CUDA GPU on this machine "
            "(--device cpu runs on the CPU)"
        )
    if found.index is not None and found.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine shows torch {torch.cuda.device_count()} GPU(s)")


def _dtype(name: str) -> torch.dtype:
    import torch

    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return getattr(torch, name)
