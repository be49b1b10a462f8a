"""The logits stage written from its definitions, token by token in float64, independent of the engine's batched
device code (engine/penalties.py): what its tests compare against."""

from __future__ import annotations

from collections import Counter

import torch

from deltamesh.protocol.sampling import SamplingParams


def reference_logits(
    logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams, eos: frozenset[int]
) -> torch.Tensor:
    """One request's next-token logits after min_tokens and logit_bias (vLLM applies them first), the repetition
    penalty (transformers' RepetitionPenaltyLogitsProcessor: each token of prompt or output once, a positive logit
    divided by the penalty, another multiplied), then OpenAI's frequency and presence penalties:
    mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence, with c[j] the count of token j in the output."""
    x = logits.double().clone()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[token] = float("-inf")
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= count * p.frequency_penalty + p.presence_penalty
    return x
