"""The default model's training (scripts/make_default_model.py): AdamW on random windows of the token stream,
warmup then cosine decay, a seeded order; its loss on held-out windows and greedy continuations of a few prompts."""

from __future__ import annotations

import math
import time

import torch
from tokenizers import Tokenizer
from transformers import Qwen3_5ForCausalLM

SEED = 0

# Training.
SEQ_LEN = 256
BATCH_SIZE = 8
PEAK_LR = 3e-3
MIN_LR_RATIO = 0.1
WARMUP_STEPS = 40
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
LOG_EVERY = 25
EVAL_WINDOWS = 64

SAMPLE_PROMPTS = ["The Python language", "A list is", "In this tutorial, we"]
SAMPLE_NEW_TOKENS = 40


def make_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, A_log, dt_bias)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decayed = [p for p in params if p.dim() >= 2]
    undecayed = [p for p in params if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": undecayed, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=(0.9, 0.95))


def learning_rate(step: int, total_steps: int) -> float:
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: Qwen3_5ForCausalLM, stream: torch.Tensor, steps: int) -> float:
    """Train on random SEQ_LEN windows of the stream; return the mean loss of the last LOG_EVERY steps."""
    generator = torch.Generator().manual_seed(SEED)
    optimizer = make_optimizer(model)
    model.train()
    recent: list[float] = []
    start = time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        offsets = torch.randint(0, len(stream) - SEQ_LEN, (BATCH_SIZE,), generator=generator)
        batch = torch.stack([stream[o : o + SEQ_LEN] for o in offsets.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        recent = (recent + [loss.item()])[-LOG_EVERY:]
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            mean = sum(recent) / len(recent)
            print(
                f"step {step + 1:5d}/{steps}  loss {mean:.4f}  lr {learning_rate(step, steps):.2e}  "
                f"{time.time() - start:6.0f}s",
                flush=True,
            )
    model.eval()
    return sum(recent) / len(recent)


@torch.no_grad()
def evaluate(model: Qwen3_5ForCausalLM, stream: torch.Tensor) -> float:
    """Mean loss over up to EVAL_WINDOWS evenly spaced, non-overlapping SEQ_LEN windows."""
    num_windows = len(stream) // SEQ_LEN
    stride = max(1, num_windows // EVAL_WINDOWS)
    windows = stream[: num_windows * SEQ_LEN].view(num_windows, SEQ_LEN)[::stride][:EVAL_WINDOWS]
    losses = [model(input_ids=batch, labels=batch).loss.item() for batch in windows.split(BATCH_SIZE)]
    return sum(losses) / len(losses)


@torch.no_grad()
def continuations(model: Qwen3_5ForCausalLM, tokenizer: Tokenizer) -> list[str]:
    """Greedy continuations of SAMPLE_PROMPTS."""
    texts = []
    for prompt in SAMPLE_PROMPTS:
        input_ids = torch.tensor([tokenizer.encode(prompt).ids])
        output = model.generate(input_ids, max_new_tokens=SAMPLE_NEW_TOKENS, do_sample=False)
        texts.append(tokenizer.decode(output[0, input_ids.shape[1] :].tolist(), skip_special_tokens=False))
    return texts
