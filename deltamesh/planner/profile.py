"""A profile: what one worker of one model and parallelism costs on one kind of machine, as `deltamesh profile`
measured it (profiler.py), and the model of an engine step's time that the simulator reads from it.

An engine step (engine/scheduler.py) carries every running decode's next token and prompt chunks under a token
budget. Its time is modelled from three measured parts:
- decodes: `decode_ms(batch, context)`, interpolated (piecewise linear, extrapolated past the ends) in a grid of
  decode-only steps measured at several batches and contexts;
- prompt chunks: a + b·N + c·W, fitted to whole prompts prefilled at several lengths and batches, with N the
  step's prompt tokens and W its causal attention's token pairs, Σ n·(o + n/2) over its chunks of n tokens
  starting at offset o (a prompt of L tokens has L²/2 of them however it is chunked);
- a mixed step (both): decode_ms + b·N + c·W + m, m fitted to steps measured with both (negative when the two
  parts share the weights' reads), and never less than either part alone.
State transfers (prefill -> decode) take `transfer_ms(prompt tokens)`, interpolated in measured pulls; memory
bounds the KV pool as the engine sizes it (engine/memory_budget.py `size_kv_pool`, without a budget).

The JSON keeps every raw measurement next to the fitted numbers and their errors, with the machine, the tree
(git revision) and the command that made it, so a profile can be checked and re-fitted later.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "deltamesh-profile"
VERSION = 1
KV_FREE_FRACTION = 0.85  # of free GPU memory, as engine/memory_budget.py sizes a pool without a budget
CPU_KV_BUDGET_BYTES = 2**30  # engine/memory_budget.py: a KV pool on CPU without a budget


class ProfileError(ValueError):
    """A profile file that cannot be used (missing, not JSON, wrong format or version, a field missing)."""


def interpolate(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear through (xs, ys) (xs ascending), extended past both ends along the end segments; one
    point: its value."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class PrefillModel:
    """ms of a step's prompt chunks: step_ms + ms_per_token·N + ms_per_mpair·W/1e6 (module docstring)."""

    step_ms: float
    ms_per_token: float
    ms_per_mpair: float  # per million attention token pairs

    def ms(self, tokens: int, pairs: float) -> float:
        return self.step_ms + self.chunk_ms(tokens, pairs)

    def chunk_ms(self, tokens: int, pairs: float) -> float:
        """What prompt chunks add to a step that runs anyway (a mixed step's decodes)."""
        return self.ms_per_token * tokens + self.ms_per_mpair * pairs / 1e6


@dataclass
class DecodeGrid:
    """Decode-only step times: [batch, context, ms] rows, at least one."""

    points: list[list[float]]

    def __post_init__(self) -> None:
        by_context: dict[float, list[tuple[float, float]]] = {}
        for batch, context, ms in self.points:
            by_context.setdefault(context, []).append((batch, ms))
        self._contexts = sorted(by_context)
        self._rows = [sorted(by_context[c]) for c in self._contexts]

    def ms(self, batch: int, context: float) -> float:
        """A decode step of `batch` requests whose contexts average `context` tokens; below the smallest batch
        measured, that batch's time (a step costs at least its weights' reads)."""
        at_context = [
            interpolate(max(batch, row[0][0]), [b for b, _ in row], [m for _, m in row]) for row in self._rows
        ]
        return max(interpolate(context, self._contexts, at_context), 0.0)


@dataclass
class TransferModel:
    """A state pull's ms against the prompt tokens it carries: [tokens, ms] rows (empty: not measured)."""

    points: list[list[float]]
    source: str = ""

    def ms(self, tokens: int) -> float:
        if not self.points:
            raise ProfileError(
                "this profile has no state-transfer times, which a prefill/decode layout needs: "
                "profile with the transfer measured, or give one (--transfer FILE)"
            )
        rows = sorted(self.points)
        return max(interpolate(tokens, [t for t, _ in rows], [m for _, m in rows]), 0.0)


@dataclass
class MemoryModel:
    """What bounds a worker's KV pool: the engine sizes it for `max_num_seqs` requests at `max_model_len`, within
    a budget (CPU: 1 GiB; CUDA: 85 % of the memory free once weights and GDN state slots are placed)."""

    page_size: int
    kv_bytes_per_token: int
    state_bytes: int  # one request's GDN conv + recurrent state (a slot)
    weights_bytes: int
    fixed_kv_budget_bytes: int | None = None  # CPU
    free_after_weights_bytes: int | None = None  # CUDA: free device memory with the weights loaded, no pools
    prefix_cache: bool = True  # the prefix cache's checkpoints take 2 x max_num_seqs more slots

    def kv_capacity_tokens(self, max_num_seqs: int, max_model_len: int) -> int:
        pages_wanted = max_num_seqs * -(-max_model_len // self.page_size)
        budget: float
        if self.fixed_kv_budget_bytes is not None:
            budget = self.fixed_kv_budget_bytes
        else:
            slots = (max_num_seqs + 1) + (2 * max_num_seqs if self.prefix_cache else 0)
            budget = KV_FREE_FRACTION * ((self.free_after_weights_bytes or 0) - slots * self.state_bytes)
        page_bytes = self.kv_bytes_per_token * self.page_size
        return max(0, min(pages_wanted, int(budget // page_bytes))) * self.page_size


@dataclass
class Profile:
    name: str  # a label: the file's stem unless given
    gpus_per_worker: int  # devices one worker takes (its ranks)
    parallelism: dict  # tensor_parallel_size, data_parallel_size, enable_expert_parallel
    model: dict  # path, name, family, load_format, params
    engine: dict  # device, dtype, state_dtype, page_size, prefix_cache, async_scheduling, torch_threads, ...
    memory: MemoryModel
    prefill: PrefillModel
    decode: DecodeGrid
    mixed_extra_ms: float
    transfer: TransferModel
    fit_errors: dict = field(default_factory=dict)  # relative errors of the fits against their own points
    measurements: dict = field(default_factory=dict)  # every raw sample, as measured
    provenance: dict = field(default_factory=dict)  # command, date_utc, machine, tree

    # ---- the step model ---------------------------------------------------------------------------------
    def step_ms(self, decodes: int, decode_context: float, prompt_tokens: int, prompt_pairs: float) -> float:
        """One engine step: `decodes` decode tokens whose contexts average `decode_context`, and prompt chunks of
        `prompt_tokens` tokens and `prompt_pairs` attention token pairs."""
        if not prompt_tokens:
            return self.decode.ms(decodes, decode_context) if decodes else 0.0
        if not decodes:
            return self.prefill.ms(prompt_tokens, prompt_pairs)
        decode = self.decode.ms(decodes, decode_context)
        alone = self.prefill.ms(prompt_tokens, prompt_pairs)
        # a negative extra (the weights read once for both) never makes the step shorter than either part alone
        return max(decode + self.prefill.chunk_ms(prompt_tokens, prompt_pairs) + self.mixed_extra_ms, decode, alone)

    def transfer_ms(self, tokens: int) -> float:
        return self.transfer.ms(tokens)

    @property
    def device(self) -> str:
        return self.engine.get("device", "cpu")

    def describe(self) -> str:
        par = self.parallelism
        parts = [f"tp{par.get('tensor_parallel_size', 1)}"]
        if par.get("data_parallel_size", 1) > 1:
            parts = [f"dp{par['data_parallel_size']}"]
        if par.get("enable_expert_parallel"):
            parts.append("ep")
        n = self.gpus_per_worker
        where = f"{n} GPU{'s' if n > 1 else ''}" if self.is_gpu else f"CPU, {n} process{'es' if n > 1 else ''}"
        return f"{self.name} ({'-'.join(parts)}, {where})"

    @property
    def is_gpu(self) -> bool:
        return self.device.startswith("cuda")

    # ---- JSON -------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = asdict(self)
        return {"format": FORMAT, "version": VERSION, **data}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def from_json(cls, data: dict, name: str | None = None, where: str = "profile") -> Profile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ProfileError(f'{where}: not a deltamesh profile (no "format": "{FORMAT}")')
        if data.get("version") != VERSION:
            raise ProfileError(f"{where}: profile version {data.get('version')!r}; this deltamesh reads {VERSION}")
        try:
            profile = cls(
                name=name or data.get("name") or where,
                gpus_per_worker=int(data["gpus_per_worker"]),
                parallelism=dict(data["parallelism"]),
                model=dict(data["model"]),
                engine=dict(data["engine"]),
                memory=MemoryModel(**data["memory"]),
                prefill=PrefillModel(**data["prefill"]),
                decode=DecodeGrid([list(map(float, p)) for p in data["decode"]["points"]]),
                mixed_extra_ms=float(data["mixed_extra_ms"]),
                transfer=TransferModel(
                    [list(map(float, p)) for p in data["transfer"]["points"]], data["transfer"].get("source", "")
                ),
                fit_errors=dict(data.get("fit_errors", {})),
                measurements=dict(data.get("measurements", {})),
                provenance=dict(data.get("provenance", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{where}: a field is missing or malformed: {e!r}") from None
        if not profile.decode.points:
            raise ProfileError(f"{where}: no decode step times")
        if profile.gpus_per_worker < 1:
            raise ProfileError(f"{where}: gpus_per_worker must be >= 1")
        values = [profile.prefill.step_ms, profile.prefill.ms_per_token, profile.prefill.ms_per_mpair]
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ProfileError(f"{where}: the prefill fit must be finite and non-negative, got {values}")
        return profile

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> Profile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ProfileError(f"{path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not JSON ({e})") from None
        return cls.from_json(
            data, name or (data.get("name") if isinstance(data, dict) else None) or path.stem, str(path)
        )
