"""What a deployment must serve: the requests (prompt and output length distributions, arrivals at a rate or a
fixed number in flight) and the service levels (SLAs) each layout is judged by."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DIST_HELP = (
    "N (every request), uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA, or file:PATH (lengths drawn from "
    "a file of integers, one per line)"
)


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution; `spec` is how it was written (DIST_HELP)."""

    spec: str
    kind: str
    params: tuple[float, ...] = ()
    values: tuple[int, ...] = ()  # file: the lengths drawn from

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        spec = str(spec).strip()
        kind, _, rest = spec.partition(":")
        try:
            if not rest:
                n = int(kind)
                if n < 1:
                    raise ValueError
                return cls(spec, "fixed", (n,))
            if kind == "file":
                text = Path(rest).read_text()
                values = tuple(int(x) for x in text.split())
                if not values or min(values) < 1:
                    raise ValueError
                return cls(spec, "file", values=values)
            params = tuple(float(x) for x in rest.split(":"))
        except OSError as e:
            raise ValueError(f"length distribution {spec!r}: {e.strerror or e}") from None
        except ValueError:
            raise ValueError(f"length distribution {spec!r}: expected {DIST_HELP}") from None
        arity = {"uniform": 2, "normal": 2, "lognormal": 2}
        if kind not in arity or len(params) != arity[kind] or not all(math.isfinite(p) for p in params):
            raise ValueError(f"length distribution {spec!r}: expected {DIST_HELP}")
        if kind == "uniform" and not 1 <= params[0] <= params[1]:
            raise ValueError(f"length distribution {spec!r}: needs 1 <= LO <= HI")
        if kind in ("normal", "lognormal") and (params[0] < 1 or params[1] < 0):
            raise ValueError(f"length distribution {spec!r}: needs a centre >= 1 and a spread >= 0")
        return cls(spec, kind, params)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            out = np.full(n, self.params[0])
        elif self.kind == "uniform":
            out = rng.integers(int(self.params[0]), int(self.params[1]) + 1, size=n)
        elif self.kind == "normal":
            out = np.rint(rng.normal(self.params[0], self.params[1], size=n))
        elif self.kind == "lognormal":
            out = np.rint(self.params[0] * np.exp(rng.normal(0.0, self.params[1], size=n)))
        else:
            out = rng.choice(np.asarray(self.values), size=n)
        return np.maximum(out, 1).astype(np.int64)

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.params[0]
        if self.kind == "uniform":
            return (self.params[0] + self.params[1]) / 2
        if self.kind == "normal":
            return self.params[0]
        if self.kind == "lognormal":
            return self.params[0] * math.exp(self.params[1] ** 2 / 2)
        return float(np.mean(self.values))


@dataclass(frozen=True)
class Traffic:
    """Requests arrive at `request_rate` per second (gamma gaps of shape `burstiness`: 1 is Poisson, as vLLM's
    benchmark; inf: evenly spaced), or `concurrency` of them are kept in flight (a client sends the next as one ends); exactly one of
    the two."""

    input_len: LengthDist
    output_len: LengthDist
    request_rate: float | None = None
    concurrency: int | None = None
    num_requests: int = 400
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.request_rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of a request rate and a concurrency")
        if self.request_rate is not None and not (0 < self.request_rate < math.inf):
            raise ValueError(f"request rate must be a positive number of requests/s, got {self.request_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.num_requests < 1:
            raise ValueError(f"number of requests must be >= 1, got {self.num_requests}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    def requests(self) -> list[tuple[float | None, int, int]]:
        """(arrival second or None for a closed loop, prompt tokens, output tokens) per request, drawn from the
        seed (the same traffic for every layout)."""
        rng = np.random.default_rng(self.seed)
        n = self.num_requests
        prompts, outputs = self.input_len.sample(rng, n), self.output_len.sample(rng, n)
        arrivals: list[float | None]
        if self.request_rate is None:
            arrivals = [None] * n
        elif math.isinf(self.burstiness):  # evenly spaced
            arrivals = [(i + 1) / self.request_rate for i in range(n)]
        else:
            gaps = np.random.default_rng([self.seed, 1]).gamma(
                self.burstiness, 1.0 / (self.request_rate * self.burstiness), size=n
            )
            arrivals = np.cumsum(gaps).tolist()
        return list(zip(arrivals, prompts.tolist(), outputs.tolist()))

    def describe(self) -> str:
        load = (
            f"{self.request_rate:g} req/s ({'Poisson' if self.burstiness == 1 else f'burstiness {self.burstiness:g}'})"
            if self.request_rate is not None
            else f"{self.concurrency} in flight"
        )
        return (
            f"prompt {self.input_len.spec}, output {self.output_len.spec} tokens, {load}, {self.num_requests} requests"
        )


@dataclass(frozen=True)
class Sla:
    """Limits in ms (None: no limit): TTFT median and 90th percentile, TPOT median and 90th percentile. A request
    counts towards goodput when its own TTFT and TPOT are within the loosest limit given for each."""

    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p90_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in self.limits().items():
            if not value > 0:
                raise ValueError(f"SLA {name} must be a positive number of ms, got {value}")

    def limits(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}

    def request_limits(self) -> tuple[float, float]:
        """(TTFT ms, TPOT ms) one request must stay within to count as good (inf: no limit)."""
        ttft = self.ttft_p90_ms or self.ttft_p50_ms or math.inf
        tpot = self.tpot_p90_ms or self.tpot_p50_ms or math.inf
        return ttft, tpot

    def misses(self, summary: dict) -> list[str]:
        """The limits a simulated summary (metrics.summarize) breaks, as words."""
        checks = {
            "ttft_p50_ms": "TTFT p50",
            "ttft_p90_ms": "TTFT p90",
            "tpot_p50_ms": "TPOT p50",
            "tpot_p90_ms": "TPOT p90",
        }
        out = []
        for key, label in checks.items():
            limit = getattr(self, key)
            if limit is not None and not summary[key] <= limit:
                out.append(f"{label} {summary[key]:.0f} > {limit:g} ms")
        if summary.get("unfinished"):
            out.append(f"{summary['unfinished']} requests never finished")
        return out

    def describe(self) -> str:
        words = {
            "ttft_p50_ms": "TTFT p50",
            "ttft_p90_ms": "TTFT p90",
            "tpot_p50_ms": "TPOT p50",
            "tpot_p90_ms": "TPOT p90",
        }
        return ", ".join(f"{words[k]} <= {v:g} ms" for k, v in self.limits().items()) or "none"
