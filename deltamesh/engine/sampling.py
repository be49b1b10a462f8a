"""Sampling parameters and the batched sampler.

Seeded sampling is stateless: the noise for a request's n-th output token depends only on (seed, n). So a
seeded request samples the same tokens whether it runs on one engine or is split across a prefill and a
decode worker, and whether or not it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltamesh.protocol.structured import StructuredOutputs

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: chosen + top k
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # the output follows a grammar (engine/grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError with a message a user can act on. Integer bounds follow the wire types
        (common.proto: uint32 max_tokens/top_k/stop_token_ids, uint64 seed), so that a value accepted at one
        edge can always be sent on to the workers."""
        _check_int("max_tokens", self.max_tokens, 1, UINT32)
        if not 0.0 <= self.temperature <= 2.0:  # OpenAI's range; the REST schema says the same
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, 0, UINT32, "(0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, UINT64)
        check_stop_strings(self.stop)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        bad = [t for t in self.stop_token_ids if not is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be integers in [0, {vocab_size}) (the vocabulary), got {bad[:8]}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS + 1)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()


UINT32, UINT64 = 2**32, 2**64
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024  # a generous cap: each one is checked on every generated token


def check_stop_strings(stop) -> None:
    """Raise ValueError unless `stop` is a short enough list of non-empty, well-formed strings (also checked by
    the REST gateway before anything is tokenised, so that its error names the parameter)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError("stop strings must be non-empty strings")
    for s in stop:
        check_text(s, "a stop string")


def is_int(x) -> bool:
    """An integer proper: JSON's true/false arrive as Python bools, which are ints too."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name: str, value, low: int, end: int, note: str = "") -> None:
    if not is_int(value) or not low <= value < end:
        shown = value if is_int(value) and abs(value) < 10**30 else f"{type(value).__name__} {str(value)[:30]}"
        raise ValueError(f"{name} must be an integer in [{low}, {end - 1}]{' ' + note if note else ''}, got {shown}")


def check_text(text: str, what: str) -> None:
    """Text must be encodable as UTF-8: JSON can carry a lone surrogate ("\\ud800"), which neither the
    tokenizer nor protobuf can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate at character {e.start}") from None


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


def _mix(seed: int, index: int) -> int:
    """A well-spread 63-bit seed for output position `index` of a seeded request."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 29)) & 0x7FFFFFFFFFFFFFFF


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, queued on the stream without waiting for it: `torch.tensor(values,
    device=cuda)` copies from pageable memory and synchronises the stream, so the host could not run ahead."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on rows of non-greedy requests; returns probabilities. Which filters
    apply is read from `params` on the host, never from the device."""
    dev = logits.device
    vocab = logits.shape[-1]
    k_list = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    temps, top_p, min_p = on_device([[p.temperature, p.top_p, p.min_p] for p in params], torch.float32, dev).T
    logits = logits / temps[:, None]
    if any(k < vocab for k in k_list) or any(p.top_p < 1 for p in params):
        top_k = on_device(k_list, torch.int64, dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
        drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs


def _rows(rows: list[int], n: int, device: torch.device) -> slice | torch.Tensor:
    """An index of `rows` out of `n` that does not wait for the device: a slice when they are all of them."""
    return slice(None) if len(rows) == n else on_device(rows, torch.int64, device)


class SampledTokens:
    """A step's sampled tokens (and logprobs where asked), computed on the device and on their way to the host.

    The copy to the host is queued behind the sampling kernels and does not wait: the engine launches the next
    step first and reads these only afterwards (`result`), so the host's work on them overlaps the GPU's."""

    def __init__(self, tokens: torch.Tensor, logprob_rows: list[int], logprob_counts: list[int], lp=None):
        self.tokens = tokens  # [N] int64 on the device: the next step's inputs are gathered from here
        self._rows, self._counts = logprob_rows, logprob_counts
        to_host = (lambda t: t.to("cpu", non_blocking=True)) if tokens.is_cuda else (lambda t: t)
        self._host = [to_host(t) for t in (tokens, *(lp or ()))]
        self._done = None
        if tokens.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(tokens.device))

    def ready(self) -> bool:
        """Whether `result` would return without waiting."""
        return self._done is None or self._done.query()

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """(token per row, logprobs per row or None); waits for the copy with the GIL released."""
        if self._done is not None:
            self._done.synchronize()
        token_list = self._host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        if self._rows:
            chosen, top_vals, top_ids = (t.tolist() for t in self._host[1:])
            for row, (i, n) in enumerate(zip(self._rows, self._counts)):
                logprobs[i] = TokenLogprobs(token_list[i], chosen[row], list(zip(top_ids[row][:n], top_vals[row][:n])))
        return token_list, logprobs


def sample_async(
    logits: torch.Tensor,  # [N, V] float32
    params: list[SamplingParams],
    output_index: list[int],  # how many tokens each request has produced so far
    generator: torch.Generator | None = None,
) -> SampledTokens:
    """Sample one token per row on the logits' device; nothing here waits for the device."""
    tokens = logits.argmax(-1)
    dev, n = logits.device, len(params)
    rand_rows = [i for i, p in enumerate(params) if not p.greedy]
    if rand_rows:
        rand = _rows(rand_rows, n, dev)
        probs = _filter(logits[rand], [params[i] for i in rand_rows])
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for row, i in enumerate(rand_rows):
            seed = params[i].seed
            if seed is not None:
                g = torch.Generator(device=dev).manual_seed(_mix(seed, output_index[i]))
                noise[row].exponential_(generator=g)
        tokens[rand] = (probs / noise).argmax(-1)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return SampledTokens(tokens, [], [])
    wanted = _rows(want, n, dev)
    lp = torch.log_softmax(logits[wanted], dim=-1)
    k = max(params[i].logprobs for i in want)
    top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
    chosen = lp.gather(1, tokens[wanted][:, None]).squeeze(1)
    return SampledTokens(tokens, want, [params[i].logprobs for i in want], (chosen, top_vals, top_ids))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_index: list[int],
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """`sample_async`, waited for."""
    return sample_async(logits, params, output_index, generator).result()
