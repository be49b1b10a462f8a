"""`deltamesh profile`: what one worker of a model and parallelism costs on this machine, measured on the engine
itself (`EngineCore` stepped directly, as a worker's loop steps it: async scheduling, CUDA graphs, the scheduler's
chunking, sampling), and fitted into a profile (profile.py).

- prefill: whole prompts of each length x batch, submitted together with max_tokens=1, every step until their
  first tokens timed (the median of --reps runs);
- decode: at each context, the largest batch that fits is placed in the pools at that context (a reservation and
  `submit_pulled`, the engine's own path for a state pulled from another worker: only the last 16 prompt tokens
  are computed; a worker over several ranks computes the contexts in full), then steps timed at every batch of
  the grid, largest first, requests aborted between them; a point is the mean of its steps (what they take end to
  end, as a served request's TPOT is), the median of the --reps rounds;
- mixed: prompts submitted beside a decode batch, every step until their first tokens timed;
- transfer: `bench/transfer.py` run as it is (a holder and a puller process over the UCX side channel), or its
  JSON given (`transfer_times.py`);
- memory: a KV page's and a state slot's bytes, the weights, and the memory free for the pools.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from deltamesh.engine.engine_config import EngineConfig
from deltamesh.planner.fitting import fit_mixed, fit_prefill
from deltamesh.planner.profile import (
    CPU_KV_BUDGET_BYTES,
    DecodeGrid,
    MemoryModel,
    Profile,
    TransferModel,
)


class MeasurementError(RuntimeError):
    """The grid cannot be measured as asked (nothing fits the KV pool, a request ended early)."""


TAIL = 16  # prompt tokens a placed decode request computes itself (the rest of its context is placed)
SETTLE = 2  # step calls after a change of the batch before timing (async scheduling runs one step ahead)


@dataclass(frozen=True)
class Mixed:
    decodes: int
    context: int
    prompts: int
    prompt_len: int

    @classmethod
    def parse(cls, spec: str) -> Mixed:
        """DECODES:CONTEXT:PROMPTS:PROMPT_LEN, e.g. 32:4096:1:8192."""
        try:
            values = [int(x) for x in spec.split(":")]
            point = cls(*values)
        except (TypeError, ValueError):
            raise ValueError(f"mixed point {spec!r}: expected DECODES:CONTEXT:PROMPTS:PROMPT_LEN") from None
        if min(values) < 1:
            raise ValueError(f"mixed point {spec!r}: every number must be >= 1")
        return point


@dataclass
class Grid:
    """What is measured (module docstring)."""

    prefill_lens: list[int]
    prefill_batches: list[int]
    decode_batches: list[int]
    decode_contexts: list[int]
    decode_steps: int
    mixed: list[Mixed]
    reps: int
    transfer_lens: list[int] = field(default_factory=list)

    @classmethod
    def default(cls, cuda: bool) -> Grid:
        if cuda:  # one shape in about three minutes on an H200 (model load and CUDA graph capture included)
            return cls(
                [1024, 4096, 8192, 16384],
                [1, 2, 4],
                [1, 8, 32, 64, 128, 256],
                [1024, 4096, 10240],
                12,
                [Mixed(32, 4096, 1, 4096), Mixed(64, 8192, 2, 8192), Mixed(128, 1024, 1, 8192)],
                3,
                [1024, 8192, 32768],
            )
        return cls(
            [64, 256, 1024],
            [1, 4],
            [1, 4, 16, 32],
            [128, 512, 2048],
            8,
            [Mixed(8, 256, 1, 512), Mixed(16, 512, 2, 1024)],
            2,
            [128, 1024, 4096],
        )

    def check(self) -> None:
        lists = (self.prefill_lens, self.prefill_batches, self.decode_batches, self.decode_contexts)
        if not all(lists) or min(min(x) for x in lists) < 1 or self.decode_steps < 1 or self.reps < 1:
            raise ValueError("every length, batch, context, step count and rep count must be >= 1 (and given)")

    @property
    def decode_margin(self) -> int:
        """Tokens a decode request generates over its ladder (and spare)."""
        return len(self.decode_batches) * (self.decode_steps + SETTLE) + TAIL + 8

    def longest(self) -> int:
        return max(
            max(self.prefill_lens) + 1,
            max(self.decode_contexts) + self.decode_margin,
            *(m.context + self.decode_margin + 64 for m in self.mixed),
            *(m.prompt_len + 1 for m in self.mixed),
        )

    def most_requests(self) -> int:
        return max(max(self.decode_batches), max(self.prefill_batches), *(m.decodes + m.prompts for m in self.mixed))


class Driver:
    """An EngineCore whose every step call is timed; requests of random token prompts."""

    def __init__(self, config: EngineConfig):
        import numpy as np

        from deltamesh.engine.core import EngineCore

        self.core = EngineCore(config)
        self.vocab = self.core.model_config.vocab_size
        self.rng = np.random.default_rng(config.seed)
        self.tokens: dict[str, int] = {}  # request id -> output tokens seen
        self._ids = itertools.count()
        # a parallel engine takes a pulled state through its hand-off area, one at a time before the request's
        # first step (engine/tp_handoff.py): its decode requests compute their contexts in full instead
        self.places = config.num_ranks == 1

    def _sink(self, out) -> None:
        self.tokens[out.request_id] += len(out.new_token_ids)

    def submit(self, n: int, length: int, max_tokens: int, placed: int = 0) -> list:
        """n requests of `length`-token random prompts; `placed`: tokens of each placed in the pools, not computed."""
        from deltamesh.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        reqs = []
        for _ in range(n):
            prompt = self.rng.integers(3, self.vocab, size=length).tolist()
            req = self.core.make_request(prompt, params, f"profile-{next(self._ids)}")
            self.tokens[req.request_id] = 0
            if placed and self.places:
                self.core.submit_pulled(req, placed, self.core.reservations.reserve(placed), self._sink)
            else:
                self.core.submit(req, self._sink)
            reqs.append(req)
        self.core.dispatch(self.core.process_commands())
        return reqs

    def step(self) -> float:
        started = time.perf_counter()
        outputs = self.core.step()
        seconds = time.perf_counter() - started
        self.core.dispatch(outputs)
        return seconds

    def until_tokens(self, reqs: list) -> float:
        """Step until every request has a token; the seconds the steps took."""
        total = 0.0
        while any(self.tokens[r.request_id] == 0 for r in reqs):
            if not self.core.has_work:
                raise MeasurementError("the engine stopped before every request had its first token")
            total += self.step()
        return total

    def end(self, reqs: list) -> None:
        for r in reqs:
            self.core.abort(r.request_id)
        self.core.dispatch(self.core.process_commands())

    def drain(self) -> None:
        while self.core.has_work:
            self.step()
        if self.core.scheduler.num_preemptions:
            raise MeasurementError("requests were preempted while profiling: the KV pool is too small for the grid")


def _log(msg: str) -> None:
    print(f"deltamesh profile: {msg}", file=sys.stderr, flush=True)


def prefill_flow(d: Driver, length: int, batch: int) -> dict:
    steps_before = d.core.stats.steps
    reqs = d.submit(batch, length, max_tokens=1)
    ms = d.until_tokens(reqs) * 1e3
    d.drain()
    return {
        "prompt_len": length,
        "batch": batch,
        "steps": d.core.stats.steps - steps_before,
        "tokens": batch * length,
        "pairs": batch * length * length / 2,
        "ms": ms,
    }


def decode_ladder(d: Driver, grid: Grid, context: int) -> list[dict]:
    """Decode-only step times at `context` for every batch of the grid that fits the pool, largest first."""
    core, margin = d.core, grid.decode_margin
    room = core.kv_pool.num_pages // core.kv_pool.pages_for(context + margin)
    batches = sorted((b for b in grid.decode_batches if b <= room), reverse=True)
    if not batches:
        _log(f"decode at context {context}: not one request fits the KV pool; skipped")
        return []
    tail = min(TAIL, context - 1)
    live = d.submit(batches[0], context, max_tokens=margin, placed=context - tail)
    d.until_tokens(live)
    rows = []
    for batch in batches:
        d.end(live[batch:])
        live = live[:batch]
        for _ in range(SETTLE):
            d.step()
        times = [d.step() * 1e3 for _ in range(grid.decode_steps)]
        if any(d.tokens[r.request_id] >= margin for r in live):
            raise MeasurementError("a decode request finished inside its timed window")
        rows.append(
            {
                "batch": batch,
                "context": context,
                "mean_context": context + statistics.fmean(d.tokens[r.request_id] for r in live),
                # the mean, not the median: the simulation adds steps end to end, and a served request's TPOT is
                # their sum over its tokens, slow steps included (as the prefill and mixed points are sums)
                "ms": statistics.fmean(times),
                "steps_ms": times,
            }
        )
    d.end(live)
    d.drain()
    return rows


def mixed_point(d: Driver, point: Mixed, margin: int) -> dict:
    """Prompts prefilled beside `point.decodes` decodes: the time of every step until their first tokens."""
    core = d.core
    tail = min(TAIL, point.context - 1)
    decodes = d.submit(point.decodes, point.context, max_tokens=margin + 64, placed=point.context - tail)
    d.until_tokens(decodes)
    for _ in range(SETTLE):
        d.step()
    steps, mixed = core.stats.steps, core.stats.mixed_steps
    prompts = d.submit(point.prompts, point.prompt_len, max_tokens=1)
    ms = d.until_tokens(prompts) * 1e3
    steps, mixed = core.stats.steps - steps, core.stats.mixed_steps - mixed
    row = {
        **vars(point),
        "context": point.context + statistics.fmean(d.tokens[r.request_id] for r in decodes),
        "steps": mixed,
        "decode_only_steps": steps - mixed,
        "tokens": point.prompts * point.prompt_len,
        "pairs": point.prompts * point.prompt_len**2 / 2,
        "ms": ms,
    }
    d.end(decodes)
    d.drain()
    return row


def _median_rows(runs: list[dict]) -> dict:
    return {**runs[0], "ms": statistics.median(r["ms"] for r in runs), "samples_ms": [r["ms"] for r in runs]}


def _rounds(reps: int, points: list, measure) -> list[list]:
    """`measure(point)` for every point, `reps` rounds of them all: a burst of other work on the machine lands
    on one sample of several points, not on every sample of one."""
    runs: list[list] = [[] for _ in points]
    for _ in range(reps):
        for i, point in enumerate(points):
            runs[i].append(measure(point))
    return runs


def measure_prefill(d: Driver, grid: Grid) -> list[dict]:
    points = [(length, batch) for length in grid.prefill_lens for batch in grid.prefill_batches]
    flows = [_median_rows(runs) for runs in _rounds(grid.reps, points, lambda p: prefill_flow(d, *p))]
    for f in flows:
        _log(f"prefill {f['batch']} x {f['prompt_len']}: {f['ms']:.1f} ms in {f['steps']} steps")
    return flows


def measure_decode(d: Driver, grid: Grid) -> list[dict]:
    rows = []
    for runs in _rounds(grid.reps, grid.decode_contexts, lambda c: decode_ladder(d, grid, c)):
        ladder = [_median_rows([run[i] for run in runs]) for i in range(len(runs[0]))]
        if not ladder:
            continue
        # the ladder's requests grow as it runs: its points are filed at the contexts they averaged, one for all
        # (a context's points must share it for the grid's interpolation)
        grown = round(statistics.fmean(r["mean_context"] for r in ladder))
        for r in ladder:
            r["context"] = grown
        _log(f"decode at {grown}, ms per step by batch: " + ", ".join(f"{r['batch']}: {r['ms']:.2f}" for r in ladder))
        rows += ladder
    if not rows:
        raise MeasurementError("no decode point fits the KV pool: lower --decode-batches or --decode-contexts")
    return rows


def measure_mixed(d: Driver, grid: Grid) -> list[dict]:
    rows = [
        _median_rows(runs) for runs in _rounds(grid.reps, grid.mixed, lambda m: mixed_point(d, m, grid.decode_margin))
    ]
    for r in rows:
        what = f"{r['prompts']} x {r['prompt_len']} beside {r['decodes']} decodes"
        _log(f"mixed: {what}: {r['ms']:.1f} ms, {r['steps']} mixed steps")
    return rows


def profile_config(engine: EngineConfig, grid: Grid) -> EngineConfig:
    """The profiled worker's engine: the user's settings, with pools and a step budget for the grid."""
    cuda = engine.device.startswith("cuda")
    return replace(
        engine,
        max_num_seqs=grid.most_requests(),
        max_model_len=engine.max_model_len or grid.longest() + engine.page_size,
        max_num_batched_tokens=engine.max_num_batched_tokens or (16384 if cuda else 4096),
        prefix_cache_checkpoints=engine.prefix_cache_checkpoints or 8,  # the slots, not the profile, want memory
    )


def memory_model(d: Driver, free_before: int | None) -> MemoryModel:
    core = d.core
    # buffers too: FP8 weights and their scales may be kept as buffers
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(core.model.parameters(), core.model.buffers()))
    cuda = core.device.type == "cuda"
    return MemoryModel(
        page_size=core.kv_pool.page_size,
        kv_bytes_per_token=core.kv_pool.page_bytes // core.kv_pool.page_size,
        state_bytes=core.state_pool.slot_bytes,
        weights_bytes=weights,
        fixed_kv_budget_bytes=None if cuda else CPU_KV_BUDGET_BYTES,
        free_after_weights_bytes=(free_before - weights) if cuda and free_before is not None else None,
        prefix_cache=core.config.prefix_cache,
    )


def run_profile(engine: EngineConfig, grid: Grid, transfer: TransferModel, name: str) -> Profile:
    import torch

    grid.check()
    config = profile_config(engine, grid)
    free_before = None
    if config.device.startswith("cuda"):
        torch.cuda.init()
        free_before = torch.cuda.mem_get_info(torch.device(config.device))[0]
    started = time.perf_counter()
    d = Driver(config)
    _log(f"engine ready in {time.perf_counter() - started:.1f} s: {d.core.kv_pool.num_pages} KV pages")
    try:
        prefill_flow(d, max(grid.prefill_lens), 1)  # warm-up: first uses of a step shape compile kernels
        flows = measure_prefill(d, grid)
        prefill, prefill_errors = fit_prefill(flows)
        decode_rows = measure_decode(d, grid)
        decode = DecodeGrid([[r["batch"], r["context"], r["ms"]] for r in decode_rows])
        mixed_rows = measure_mixed(d, grid)
        mixed_extra, mixed_errors = fit_mixed(mixed_rows, prefill, decode)
        memory = memory_model(d, free_before)
        core = d.core
        engine_info = {
            "device": config.device,
            "dtype": config.dtype,  # as given (torch_dtype: what auto resolved to)
            "torch_dtype": str(core.config.torch_dtype()).removeprefix("torch."),
            "state_dtype": config.state_dtype,
            "quantization": config.quantization,
            "page_size": config.page_size,
            "prefix_cache": config.prefix_cache,
            "async_scheduling": config.async_scheduling,
            "cuda_graphs": config.cuda_graphs,
            "max_num_batched_tokens": config.resolved_max_num_batched_tokens(),
            "torch_threads": torch.get_num_threads(),
            "kernels": dict(core.kernels.chosen),
        }
        model = {
            "path": config.model,
            "name": Path(config.model).resolve().name,
            "family": core.model_config.family,
            "load_format": config.load_format,
            "params": sum(p.numel() for p in core.model.parameters()),
        }
    finally:
        d.core.close()
    return Profile(
        name=name,
        gpus_per_worker=config.num_ranks,  # GPUs; on CPU, the worker's processes
        parallelism={
            "tensor_parallel_size": config.tensor_parallel_size,
            "data_parallel_size": config.data_parallel_size,
            "enable_expert_parallel": config.enable_expert_parallel,
        },
        model=model,
        engine=engine_info,
        memory=memory,
        prefill=prefill,
        decode=decode,
        mixed_extra_ms=mixed_extra,
        transfer=transfer,
        fit_errors={"prefill": prefill_errors, "mixed": mixed_errors},
        measurements={
            "prefill": flows,
            "decode": decode_rows,
            "mixed": mixed_rows,
            "seconds": round(time.perf_counter() - started, 1),
        },
    )
