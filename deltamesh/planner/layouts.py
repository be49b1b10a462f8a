"""A deployment layout (colocated workers, or x prefill + y decode workers), each role's profile, worker count and
per-worker limits, and the commands that deploy it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from deltamesh.planner.profile import Profile


@dataclass(frozen=True, eq=False)
class Role:
    profile: Profile
    workers: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int | None = None  # each worker's KV pool when known (a share of a GPU); else sized from the profile

    @property
    def gpus(self) -> int:
        return self.workers * self.profile.gpus_per_worker

    def limits(self) -> str:
        return f"seqs {self.max_num_seqs}, budget {self.max_num_batched_tokens}"


@dataclass(frozen=True, eq=False)
class Layout:
    """Exactly one of `colocated` and (`prefill`, `decode`). `max_model_len`: the context every worker is sized
    for (the traffic's longest request). `one_gpu`: every worker on the same GPU (each in a share of its memory,
    `Role.kv_tokens`), taking turns on it."""

    max_model_len: int
    colocated: Role | None = None
    prefill: Role | None = None
    decode: Role | None = None
    one_gpu: bool = False

    def __post_init__(self) -> None:
        if (self.colocated is None) == (self.prefill is None or self.decode is None):
            raise ValueError("a layout is colocated workers, or prefill and decode workers")

    @property
    def disaggregated(self) -> bool:
        return self.colocated is None

    def prefill_decode(self) -> tuple[Role, Role]:
        """A disaggregated layout's prefill and decode roles."""
        assert self.prefill is not None and self.decode is not None, "a disaggregated layout (__post_init__)"
        return self.prefill, self.decode

    @property
    def roles(self) -> list[Role]:
        return [self.colocated] if self.colocated else list(self.prefill_decode())

    @property
    def gpus(self) -> int:
        if self.one_gpu:
            return max(r.profile.gpus_per_worker for r in self.roles)
        return sum(r.gpus for r in self.roles)

    @property
    def label(self) -> str:
        if self.colocated:
            label = f"colocated x{self.colocated.workers}"
        else:
            p, d = self.prefill_decode()
            label = f"{p.workers}P{d.workers}D"
        return label + " on one GPU" * self.one_gpu

    def describe(self) -> str:
        if self.colocated:
            r = self.colocated
            return f"{self.label} [{r.profile.describe()}; {r.limits()}]"
        p, d = self.prefill_decode()
        return f"{self.label} [P: {p.profile.describe()}; D: {d.profile.describe()}; {p.limits()}]"

    def to_json(self) -> dict:
        def role(r: Role) -> dict:
            return {
                "profile": r.profile.name,
                "workers": r.workers,
                "gpus_per_worker": r.profile.gpus_per_worker,
                "max_num_seqs": r.max_num_seqs,
                "max_num_batched_tokens": r.max_num_batched_tokens,
            }

        out = {"label": self.label, "gpus": self.gpus, "max_model_len": self.max_model_len}
        if self.colocated:
            return {**out, "colocated": role(self.colocated)}
        p, d = self.prefill_decode()
        return {**out, "prefill": role(p), "decode": role(d)}

    # ---- how to deploy it ---------------------------------------------------------------------------------
    def commands(self) -> list[str]:
        """`deltamesh serve` when one command can start it (every worker on the same flags), else a router and
        one command per worker, each on its own GPUs (processes started by hand share DELTAMESH_MESH_SECRET)."""
        if self.colocated:
            r = self.colocated
            flags = ["--colocated", "--decode-workers", str(r.workers)]
            return [_join(["deltamesh", "serve", *flags, *self._worker_flags(r), *self._gpus(r.gpus)])]
        p, d = self.prefill_decode()
        if self._worker_flags(p) == self._worker_flags(d):
            counts = ["--prefill-workers", str(p.workers), "--decode-workers", str(d.workers)]
            return [_join(["deltamesh", "serve", *counts, *self._worker_flags(p), *self._gpus(self.gpus)])]
        model = p.profile.model
        lines = [
            "export DELTAMESH_MESH_SECRET=$(openssl rand -hex 32)",
            _join(["deltamesh", "router", "--model", model.get("path", "MODEL"), "--control-port", "50052"]),
        ]
        gpu = 0
        for role, r in (("prefill", p), ("decode", d)):
            for _ in range(r.workers):
                ids = ",".join(str(g) for g in range(gpu, gpu + r.profile.gpus_per_worker))
                gpu += r.profile.gpus_per_worker
                env = f"CUDA_VISIBLE_DEVICES={ids} " if r.profile.is_gpu else ""
                worker = ["deltamesh", role, "--router", "127.0.0.1:50052", *self._worker_flags(r)]
                lines.append(env + _join(worker) + " &")
        return lines

    def _worker_flags(self, r: Role) -> list[str]:
        prof = r.profile
        model, engine, par = prof.model, prof.engine, prof.parallelism
        flags = ["--model", model.get("path", "MODEL")]
        if model.get("load_format", "auto") != "auto":
            flags += ["--load-format", model["load_format"]]
        flags += ["--device", "cuda" if prof.is_gpu else "cpu"]
        for key in ("dtype", "state_dtype", "quantization"):
            default = {"dtype": "auto", "state_dtype": "float32", "quantization": "auto"}[key]
            if engine.get(key, default) != default:
                flags += [f"--{key.replace('_', '-')}", str(engine[key])]
        if par.get("tensor_parallel_size", 1) > 1:
            flags += ["--tensor-parallel-size", str(par["tensor_parallel_size"])]
        if par.get("data_parallel_size", 1) > 1:
            flags += ["--data-parallel-size", str(par["data_parallel_size"])]
        if par.get("enable_expert_parallel"):
            flags.append("--enable-expert-parallel")
        if not engine.get("prefix_cache", True):
            flags.append("--no-prefix-cache")
        return flags + [
            "--max-num-seqs",
            str(r.max_num_seqs),
            "--max-num-batched-tokens",
            str(r.max_num_batched_tokens),
            "--max-model-len",
            str(self.max_model_len),
        ]

    def _gpus(self, count: int) -> list[str]:
        if not self.roles[0].profile.is_gpu:
            return []
        return ["--gpus", ",".join(str(g) for g in range(count))]


def _join(words: list[str]) -> str:
    return shlex.join(words)
