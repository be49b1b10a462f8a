"""bench/serve.py's requests: random prompts of the asked lengths (token ids, or text for openai-chat), the
warm-up request, and when each request is issued (Poisson / gamma arrivals, as vLLM's random dataset)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_TEXT_FIT_ROUNDS = 8  # rounds to fit random chat text to its target token count


@dataclass
class SampleRequest:
    prompt: list[int] | str  # token ids (openai, grpc) or text (openai-chat)
    prompt_len: int  # tokens sent (for text: the content's own tokens; the server's usage wins)
    output_len: int  # max_tokens requested (== tokens generated, with ignore_eos)


class Vocabulary:
    """What the benchmark needs of the model: how many token ids there are, which are special (never sent),
    and the tokenizer (text prompts only). Read from a Hugging Face checkpoint directory."""

    def __init__(self, model_dir: str | Path | None, vocab_size: int | None = None):
        self.model_dir = Path(model_dir) if model_dir else None
        self.tokenizer = None
        specials: set[int] = set()
        sizes = []
        if self.model_dir is not None:
            cfg = _read_json(self.model_dir / "config.json")
            text_cfg = cfg.get("text_config") or cfg
            if text_cfg.get("vocab_size"):
                sizes.append(int(text_cfg["vocab_size"]))
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                for c in (cfg, text_cfg):
                    value = c.get(key)
                    specials.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
            tok_path = self.model_dir / "tokenizer.json"
            if tok_path.is_file():
                from tokenizers import Tokenizer

                self.tokenizer = Tokenizer.from_file(str(tok_path))
                sizes.append(self.tokenizer.get_vocab_size(with_added_tokens=True))
                added = _read_json(tok_path).get("added_tokens", [])
                specials.update(t["id"] for t in added if t.get("special"))
        if vocab_size:
            sizes.append(int(vocab_size))
        if not sizes:
            raise ValueError(
                f"cannot tell the vocabulary size: no config.json or tokenizer.json in {model_dir} "
                "(pass --model-dir, or use --backend grpc, whose server reports it)"
            )
        self.size = min(sizes)
        self.special_ids = sorted(i for i in specials if 0 <= i < self.size)
        mask = np.ones(self.size, dtype=bool)
        mask[self.special_ids] = False
        self.allowed = np.flatnonzero(mask)
        if len(self.allowed) == 0:
            raise ValueError("the vocabulary has no non-special tokens")

    def random_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.allowed[rng.integers(0, len(self.allowed), size=n)].tolist()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def random_text(self, rng: np.random.Generator, n: int) -> tuple[str, int]:
        """Text of about n tokens made of random non-special tokens; returns (text, its token count)."""
        if self.tokenizer is None:
            raise ValueError(f"--backend openai-chat needs a tokenizer.json in --model-dir ({self.model_dir})")
        text = self.tokenizer.decode(self.random_ids(rng, n), skip_special_tokens=True)
        ids = self.encode(text)
        for _ in range(MAX_TEXT_FIT_ROUNDS):  # re-encoding merges or splits tokens: trim / top up
            if len(ids) > n:
                text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            elif len(ids) < n:
                text += self.tokenizer.decode(self.random_ids(rng, n - len(ids)), skip_special_tokens=True)
            else:
                break
            ids = self.encode(text)
        return text, len(ids)


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """n lengths uniform in [length*(1-r), length*(1+r)] (integers, at least 1), as vLLM's random dataset."""
    lo = max(1, int(length * (1 - range_ratio)))
    hi = max(lo, int(length * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def sample_requests(args: argparse.Namespace, vocab: Vocabulary) -> list[SampleRequest]:
    rng = np.random.default_rng(args.seed)
    in_lens = sample_lengths(rng, args.num_prompts, args.input_len, args.range_ratio)
    out_lens = sample_lengths(rng, args.num_prompts, args.output_len, args.range_ratio)
    return [_random_request(args, vocab, rng, n_in, n_out) for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist())]


def warmup_request(args: argparse.Namespace, vocab: Vocabulary, like: SampleRequest) -> SampleRequest:
    """A request of `like`'s lengths whose prompt is none of the measured ones (its own random stream): with a
    server's prefix cache on, a warm-up on a measured prompt would make that request a cache hit."""
    rng = np.random.default_rng([args.seed, 2])  # (stream 1: arrival times)
    return _random_request(args, vocab, rng, like.prompt_len, like.output_len)


def _random_request(
    args: argparse.Namespace, vocab: Vocabulary, rng: np.random.Generator, n_in: int, n_out: int
) -> SampleRequest:
    """Random text (openai-chat) or token ids of about n_in tokens, asking for n_out."""
    if args.backend == "openai-chat":
        text, n = vocab.random_text(rng, n_in)
        return SampleRequest(text, n, n_out)
    return SampleRequest(vocab.random_ids(rng, n_in), n_in, n_out)


def arrival_times(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is issued: gamma-distributed gaps of mean 1/rate
    (shape = burstiness; 1 = Poisson), rescaled so the last one lands at n/rate as vLLM does; all 0 at inf."""
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng([seed, 1])  # its own stream: prompts don't change the schedule
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return times.tolist()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
