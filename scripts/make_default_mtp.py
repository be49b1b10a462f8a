"""Train the MTP module of deltamesh's default model (``models/deltamesh-tiny``), so that speculative decoding has a
real draft source on any machine (``deltamesh serve --speculative-tokens K`` on the default model), and measure
how often the engine accepts its drafts.

The module is the one Qwen ships (scripts/mtp_head.py): at position t it reads the frozen model's final hidden
state h_t and the embedding of token t+1, and is trained to predict token t+2 with cross-entropy through the
model's own (tied) LM head, as Qwen3.5's MTP objective does. Its decoder layer starts from a copy of the model's
last full-attention layer, its fc from "keep the hidden state" ([0 | I]); only the MTP module trains (the
embedding, LM head and main layers are frozen). Data: the training stream of scripts/make_default_model.py
(rebuilt with the committed tokenizer), random windows in a seeded order.

Then the engine itself (CPU, float32) decodes the held-out documents' first tokens greedily with
``--speculative-tokens 3`` and counts, per draft position, the drafts it accepted: the acceptance written into the
model card and bench/RESULTS.md. Deterministic for the same versions; about 10 minutes on 2 idle CPU cores::

    .venv/bin/python scripts/make_default_mtp.py --model models/deltamesh-tiny
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.default_model_data import build_documents, split_documents, token_stream
from scripts.mtp_head import MtpHead

SEED = 0
STEPS = 600
SEQ_LEN, BATCH_SIZE = 256, 8
PEAK_LR, WARMUP_STEPS, MIN_LR_RATIO, GRAD_CLIP = 2e-3, 30, 0.1, 1.0
LOG_EVERY = 50
MEASURE_PROMPTS, MEASURE_PROMPT_TOKENS, MEASURE_NEW_TOKENS, MEASURE_K = 48, 32, 64, 3
CARD_HEADING = "## MTP module (speculative decoding)"


def learning_rate(step: int) -> float:
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, STEPS - WARMUP_STEPS)
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def init_head(model) -> MtpHead:
    head = MtpHead(model)
    last_attention = max(i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention")
    head.layers[0].load_state_dict(model.model.layers[last_attention].state_dict())
    h = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        for norm in (head.pre_fc_norm_embedding, head.pre_fc_norm_hidden):
            norm.weight.zero_()  # (1 + w): unit scale
        head.norm.weight.copy_(model.model.norm.weight)
    return head


def mtp_loss(model, head: MtpHead, windows: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of token t+2 from (h_t, token t+1) over every position of the windows."""
    with torch.no_grad():
        hidden = model.model(windows).last_hidden_state
    positions = torch.arange(windows.shape[1] - 1).expand(windows.shape[0], -1)
    g = head(model, windows[:, 1:], hidden[:, :-1], positions)[:, :-1]
    logits = model.lm_head(g)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 2:].flatten())


def train(model, head: MtpHead, stream: torch.Tensor) -> float:
    generator = torch.Generator().manual_seed(SEED)
    params = [p for p in head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.0)
    recent: list[float] = []
    start = time.time()
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        offsets = torch.randint(0, len(stream) - SEQ_LEN, (BATCH_SIZE,), generator=generator)
        loss = mtp_loss(model, head, torch.stack([stream[o : o + SEQ_LEN] for o in offsets.tolist()]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        recent = (recent + [loss.item()])[-LOG_EVERY:]
        if (step + 1) % LOG_EVERY == 0 or step + 1 == STEPS:
            print(f"step {step + 1:4d}/{STEPS}  mtp loss {sum(recent) / len(recent):.4f}  {time.time() - start:5.0f}s")
    return sum(recent) / len(recent)


def held_out_prompts(stream: torch.Tensor) -> list[list[int]]:
    """MEASURE_PROMPTS windows of MEASURE_PROMPT_TOKENS spread over the held-out token stream."""
    stride = (len(stream) - MEASURE_PROMPT_TOKENS) // MEASURE_PROMPTS
    return [stream[i * stride : i * stride + MEASURE_PROMPT_TOKENS].tolist() for i in range(MEASURE_PROMPTS)]


def run_acceptance(
    model_dir: Path | str, prompts: list[list[int]], draft_vocab: str | None = None
) -> tuple[dict, list[list[int]]]:
    """The engine's own greedy speculative decoding of `prompts` (with a reduced draft vocabulary if given): drafts
    accepted per position, and the output tokens."""
    from deltamesh.engine import Engine, EngineConfig, SamplingParams

    params = SamplingParams(max_tokens=MEASURE_NEW_TOKENS, temperature=0, ignore_eos=True)
    config = EngineConfig(
        model=str(model_dir), speculative_tokens=MEASURE_K, speculative_draft_vocab=draft_vocab, prefix_cache=False
    )
    with Engine(config) as engine:
        outputs = engine.generate(prompts, params)
        stats = engine.core.stats
    verified = stats.spec_drafts / MEASURE_K
    acceptance = {
        "prompts": len(prompts),
        "new_tokens": MEASURE_NEW_TOKENS,
        "k": MEASURE_K,
        "per_position": [round(n / verified, 3) for n in stats.spec_accepted_at[:MEASURE_K]],
        "tokens_per_step": round(1 + stats.spec_accepted / verified, 3),
    }
    return acceptance, [o.token_ids for o in outputs]


def measure_acceptance(model_dir: Path, stream: torch.Tensor) -> dict:
    """The engine's own greedy speculative decoding on held-out text: drafts accepted per position."""
    return run_acceptance(model_dir, held_out_prompts(stream))[0]


def write_card(model_dir: Path, stats: dict) -> None:
    card_path = model_dir / "README.md"
    card = card_path.read_text()
    card = card[: card.index(CARD_HEADING)].rstrip() + "\n" if CARD_HEADING in card else card
    acc = stats["acceptance"]
    card += f"""
{CARD_HEADING}

`mtp.safetensors`: the one-layer MTP module Qwen3.5 checkpoints ship (`mtp.*`: fc, pre-fc norms, one full-attention
decoder layer, final norm; {stats["params"]:,} parameters), trained on the frozen model by
`scripts/make_default_mtp.py` ({STEPS} AdamW steps of {BATCH_SIZE} x {SEQ_LEN} tokens, peak lr {PEAK_LR:g}, seed
{SEED}; final loss {stats["loss"]:.3f} for the token two ahead). `deltamesh serve --speculative-tokens K` drafts
with it. The engine's greedy speculative decoding of {acc["prompts"]} held-out prompts ({acc["new_tokens"]} new
tokens each, K = {acc["k"]}, CPU) accepted the drafts at positions 1..{acc["k"]} at rates {acc["per_position"]}
({acc["tokens_per_step"]} tokens per verify step).
"""
    card_path.write_text(card)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/deltamesh-tiny")
    args = p.parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    model_dir = Path(args.model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train_docs, val_docs = split_documents(build_documents())
    train_stream, val_stream = token_stream(tokenizer, train_docs), token_stream(tokenizer, val_docs)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    head = init_head(model)
    loss = train(model, head, train_stream)
    tensors = {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(model_dir / "mtp.safetensors"), metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    acceptance = measure_acceptance(model_dir, val_stream)
    print(f"acceptance per position {acceptance['per_position']}, {acceptance['tokens_per_step']} tokens per step")
    params = sum(v.numel() for v in tensors.values())
    write_card(model_dir, {"params": params, "loss": loss, "acceptance": acceptance})
    print(f"wrote {model_dir / 'mtp.safetensors'} ({params:,} parameters)")


if __name__ == "__main__":
    main()
