"""Build deltamesh's embedded default model, ``models/deltamesh-tiny``.

The model is a tiny, dense Qwen3.5-style hybrid (Gated DeltaNet + gated full
attention) built with Hugging Face transformers' own ``Qwen3_5ForCausalLM``, so
the engine can be checked against the reference implementation on any machine,
without downloading anything. It is meant for demos and tests only.

Everything is made from text shipped with the running CPython (3.11+):

* data: ``pydoc_data.topics`` (the language reference topics behind ``help()``)
  plus the docstrings of the standard library's modules, classes and functions,
  read with ``ast`` from the interpreter's stdlib directory in sorted order.
  Every third docstring is wrapped in a ChatML exchange ("What does X do?"), so
  the model also learns the chat format and to end replies with ``<|im_end|>``.
  Every 50th document is held out for validation.
* tokenizer: byte-level BPE (4096 tokens) trained with ``tokenizers``, using the
  same normaliser / pre-tokeniser / decoder pipeline as Qwen3.5's tokenizer.
  Special tokens: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2.
* model: 6 layers (GDN, GDN, attention, GDN, GDN, attention), hidden size 128,
  trained on 2 CPU threads with AdamW, warmup + cosine decay, a fixed number of
  steps and a seeded data order, then saved as float32 safetensors.
* Qwen3.5's format, added after training: the rest of Qwen3.5's added vocabulary
  (``<think>``, ``</think>``, ``<tool_call>``, ``<tool_response>``, the vision, audio
  and fill-in-the-middle markers; ids 4096 and up, special or not as Qwen3.5 marks
  them), whose embeddings are seeded random rows (the training data never has
  them), and the chat template in ``scripts/deltamesh_tiny_chat_template.jinja``
  (Qwen3.5's structure: thinking, tools, tool calls and results). The training data
  keeps the plain ChatML exchanges of ``TRAINING_CHAT_TEMPLATE``, so the weights do
  not depend on the served template.

The run is deterministic: the same interpreter, torch, transformers and tokenizers
versions reproduce the same files (wall-clock time does not matter, only the step
count). The defaults reproduce the committed model and take about 9 minutes on
2 otherwise idle CPU cores::

    .venv/bin/python scripts/make_default_model.py --out models/deltamesh-tiny
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer
from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.default_model_card import write_model_card
from scripts.default_model_data import (
    ENDOFTEXT,
    IM_END,
    build_documents,
    split_documents,
    token_stream,
    train_tokenizer,
)
from scripts.default_model_format import MODEL_MAX_LENGTH, add_qwen3_5_format, save_tokenizer
from scripts.default_model_training import SAMPLE_PROMPTS, SEED, continuations, evaluate, train

DEFAULT_OUT = "models/deltamesh-tiny"
DEFAULT_STEPS = 800


def model_config(tokenizer: Tokenizer) -> Qwen3_5TextConfig:
    eos_ids = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)]
    return Qwen3_5TextConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=6,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        # 64 * 0.25 = 16 rotary dims = 8 frequencies, split 3/3/2 over (t, h, w) like Qwen3.5's 11/11/10.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        max_position_embeddings=MODEL_MAX_LENGTH,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        # pad_token_id stays unset: it would become the embedding's padding_idx and freeze <|endoftext|>.
        bos_token_id=None,
        eos_token_id=eos_ids,
    )


def generation_config(config: Qwen3_5TextConfig, tokenizer: Tokenizer) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=None,
        eos_token_id=config.eos_token_id,
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
        do_sample=False,
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()

    train_docs, val_docs = split_documents(build_documents())
    tokenizer = train_tokenizer(train_docs)
    train_stream, val_stream = token_stream(tokenizer, train_docs), token_stream(tokenizer, val_docs)
    print(
        f"{len(train_docs)} train / {len(val_docs)} val documents, {len(train_stream):,} / {len(val_stream):,} tokens",
        flush=True,
    )

    config = model_config(tokenizer)
    model = Qwen3_5ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters", flush=True)

    start = time.time()
    train_loss = train(model, train_stream, args.steps)
    print(f"trained {args.steps} steps in {time.time() - start:.0f}s", flush=True)
    val_loss = evaluate(model, val_stream)
    print(
        f"final train loss {train_loss:.4f}  val loss {val_loss:.4f}  "
        f"(eval-mode train loss {evaluate(model, train_stream):.4f})",
        flush=True,
    )

    samples = list(zip(SAMPLE_PROMPTS, continuations(model, tokenizer)))
    for prompt, text in samples:
        print(f"{prompt!r} -> {text!r}", flush=True)
    add_qwen3_5_format(model, tokenizer)
    config = model.config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = generation_config(config, tokenizer)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    write_model_card(
        out,
        {
            "config": config,
            "params": sum(p.numel() for p in model.parameters()),
            "steps": args.steps,
            "out": args.out,
            "samples": samples,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "train_tokens": len(train_stream),
            "val_tokens": len(val_stream),
        },
    )
    print(f"saved to {out}", flush=True)


if __name__ == "__main__":
    main()
