"""The default model's card (models/deltamesh-tiny/README.md): its shape, tokenizer, how it was made, its losses
and sample continuations."""

from __future__ import annotations

import platform
from pathlib import Path

import tokenizers
import torch
import transformers

from scripts.default_model_data import VOCAB_SIZE
from scripts.default_model_format import QWEN3_5_ADDED_TOKENS
from scripts.default_model_training import BATCH_SIZE, PEAK_LR, SAMPLE_NEW_TOKENS, SEED, SEQ_LEN, WARMUP_STEPS


def write_model_card(out: Path, stats: dict) -> None:
    config = stats["config"]
    layers = ", ".join("GDN" if kind == "linear_attention" else "attention" for kind in config.layer_types)
    samples = "\n".join(f"* `{prompt}` → `{text!r}`" for prompt, text in stats["samples"])
    card = f"""# deltamesh-tiny

deltamesh's embedded default model: a tiny Qwen3.5-style hybrid language model for
**demos and tests only**. It writes English-looking text about Python and knows nothing else.

| | |
|---|---|
| class | transformers `Qwen3_5ForCausalLM`, `model_type` `qwen3_5_text`, dense |
| layers | {config.num_hidden_layers}: {layers} |
| hidden / MLP | {config.hidden_size} / {config.intermediate_size} |
| attention | {config.num_attention_heads} query / {config.num_key_value_heads} KV heads, head dim {config.head_dim}, \
output gate, partial RoPE {config.rope_parameters["partial_rotary_factor"]}, theta {config.rope_parameters["rope_theta"]:g} |
| Gated DeltaNet | {config.linear_num_key_heads} key / {config.linear_num_value_heads} value heads, \
head dims {config.linear_key_head_dim} / {config.linear_value_head_dim}, conv kernel {config.linear_conv_kernel_dim} |
| weights | {stats["params"]:,} parameters, float32, tied embeddings (no `lm_head.weight` stored) |
| tokenizer | byte-level BPE, {VOCAB_SIZE} tokens, Qwen3.5's pre-tokeniser, and Qwen3.5's {len(QWEN3_5_ADDED_TOKENS)} other added tokens ({config.vocab_size} in all) |
| chat template | Qwen3.5's format: thinking (on unless `enable_thinking` is false), tools, XML-style tool calls, tool results |

Special tokens: `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2. Plain completion ends with
`<|endoftext|>`, chat replies with `<|im_end|>`; `eos_token_id` is `{config.eos_token_id}` in both
`config.json` and `generation_config.json`. Qwen3.5's other added tokens follow the trained vocabulary (ids
{VOCAB_SIZE} to {config.vocab_size - 1}), marked special or not as Qwen3.5 marks them: `<think>`, `</think>`,
`<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` and the fill-in-the-middle markers are not
special (they stay in decoded text), the vision and audio markers are. Their embeddings are seeded random rows:
the training data below never has them, and its chat exchanges are plain ChatML, so the model has not learnt
Qwen3.5's chat format; it only carries its tokens and template, so that the server's tool-call and reasoning
handling runs end to end on it.

How it was made: `scripts/make_default_model.py`, deterministic for the same versions of
Python ({platform.python_version()}), torch ({torch.__version__}), transformers ({transformers.__version__})
and tokenizers ({tokenizers.__version__}):

```
.venv/bin/python scripts/make_default_model.py --out {stats["out"]} --steps {stats["steps"]}
```

* Data: CPython's own `pydoc_data.topics` plus stdlib docstrings, {stats["train_tokens"]:,} training and
  {stats["val_tokens"]:,} held-out validation tokens; every third docstring is a ChatML question/answer.
* Training: {stats["steps"]} AdamW steps of {BATCH_SIZE} x {SEQ_LEN} tokens, peak lr {PEAK_LR:g},
  {WARMUP_STEPS} warmup steps then cosine decay, seed {SEED}, 2 CPU threads.
* Final train loss {stats["train_loss"]:.3f}, validation loss {stats["val_loss"]:.3f}.

Greedy continuations ({SAMPLE_NEW_TOKENS} new tokens):

{samples}
"""
    (out / "README.md").write_text(card)
