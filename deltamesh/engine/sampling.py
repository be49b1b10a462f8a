"""The batched sampler (the parameters it reads: deltamesh/protocol/sampling.py).

Seeded sampling is stateless: the noise for a request's n-th output token depends only on (seed, n). So a
seeded request samples the same tokens whether it runs on one engine or is split across a prefill and a
decode worker, and whether or not it was preempted and recomputed.
"""

from __future__ import annotations

import numpy as np
import torch

from deltamesh.engine.request import TokenLogprobs
from deltamesh.protocol.sampling import SamplingParams


def _mix(seed: int, index: int) -> int:
    """A well-spread 63-bit seed for output position `index` of a seeded request."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 29)) & 0x7FFFFFFFFFFFFFFF


def on_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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
    raw_logits: torch.Tensor | None = None,
) -> SampledTokens:
    """Sample one token per row on the logits' device; nothing here waits for the device. Logprobs are of
    `raw_logits` where given (the logits before penalties and biases: penalties.py), else of `logits`."""
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
    asked = {i: p.logprobs for i, p in enumerate(params) if p.logprobs is not None}
    want = list(asked)
    if not want:
        return SampledTokens(tokens, [], [])
    wanted = _rows(want, n, dev)
    lp = torch.log_softmax((logits if raw_logits is None else raw_logits)[wanted], dim=-1)
    top_vals, top_ids = lp.topk(max(*asked.values(), 1), dim=-1)
    chosen = lp.gather(1, tokens[wanted][:, None]).squeeze(1)
    return SampledTokens(tokens, want, list(asked.values()), (chosen, top_vals, top_ids))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_index: list[int],
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """`sample_async`, waited for."""
    return sample_async(logits, params, output_index, generator).result()
