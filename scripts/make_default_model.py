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
import ast
import json
import math
import platform
import re
import sysconfig
import time
from pathlib import Path
from pydoc_data.topics import topics as PYDOC_TOPICS

import jinja2
import tokenizers
import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

DEFAULT_OUT = "models/deltamesh-tiny"
DEFAULT_STEPS = 800
SEED = 0

# Data.
SKIPPED_STDLIB_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
MIN_WORDS = 4
CHAT_EVERY = 3
VAL_EVERY = 50

# Tokenizer.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
VOCAB_SIZE = 4096
# The rest of Qwen3.5's added tokens, in Qwen's order, each with whether Qwen3.5 marks it special (a special token
# is left out of decoded text; <think>, <tool_call> and the like are not special, so they stay in the text that
# the gateway's reasoning and tool-call parsers read).
QWEN3_5_ADDED_TOKENS = [
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]
ADDED_EMBEDDING_STD = 0.02  # the embeddings' init scale (initializer_range): the added rows start as untrained ones
# Qwen3.5's pre-tokenisation regex (transformers' tokenization_qwen3_5.py).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# The training data's chat exchanges (plain ChatML); the served template is CHAT_TEMPLATE_FILE's.
TRAINING_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
CHAT_TEMPLATE_FILE = Path(__file__).with_name("deltamesh_tiny_chat_template.jinja")
MODEL_MAX_LENGTH = 4096

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


# --------------------------------------------------------------------------- data


def normalise(text: str) -> str:
    """Expand tabs, drop trailing spaces and squeeze runs of blank lines."""
    lines = [line.rstrip() for line in text.expandtabs(4).splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def module_docstrings(tree: ast.Module, module: str):
    """Yield (kind, name, docstring) for a module and its classes and functions, in source order."""
    stack = [("module", module, tree)]
    while stack:
        kind, name, node = stack.pop()
        doc = ast.get_docstring(node)
        if doc:
            yield kind, name, doc
        children = [
            ("class" if isinstance(child, ast.ClassDef) else "function", child.name, child)
            for child in ast.iter_child_nodes(node)
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        stack.extend(reversed(children))


def stdlib_docstrings():
    """Yield (kind, name, docstring) over the interpreter's own stdlib sources, sorted by path."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if SKIPPED_STDLIB_DIRS.intersection(relative.parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        yield from module_docstrings(tree, module)


def as_chat(kind: str, name: str, text: str) -> str:
    """Render a docstring as a ChatML exchange answering a question about its object."""
    question = {
        "module": f"What is the {name} module for?",
        "class": f"What is the {name} class?",
        "function": f"What does {name}() do?",
    }[kind]
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
    return jinja2.Template(TRAINING_CHAT_TEMPLATE).render(messages=messages)


def build_documents() -> list[str]:
    """All training documents in a fixed order: pydoc topics, then stdlib docstrings (deduplicated)."""
    documents = [normalise(PYDOC_TOPICS[key]) for key in sorted(PYDOC_TOPICS)]
    seen: set[str] = set()
    for kind, name, doc in stdlib_docstrings():
        text = normalise(doc)
        if len(text.split()) < MIN_WORDS or text in seen:
            continue
        seen.add(text)
        documents.append(as_chat(kind, name, text) if len(seen) % CHAT_EVERY == 0 else text)
    return documents


def split_documents(documents: list[str]) -> tuple[list[str], list[str]]:
    train = [doc for i, doc in enumerate(documents) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [doc for i, doc in enumerate(documents) if i % VAL_EVERY == VAL_EVERY - 1]
    return train, val


# ---------------------------------------------------------------------- tokenizer


def train_tokenizer(documents: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def token_stream(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """Concatenate the documents' tokens, each document followed by <|endoftext|>."""
    eos = tokenizer.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# -------------------------------------------------------------------------- model


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


# ----------------------------------------------------------------- Qwen3.5's format


def add_qwen3_5_format(model: Qwen3_5ForCausalLM, tokenizer: Tokenizer) -> None:
    """Qwen3.5's other added tokens after the trained vocabulary (one at a time: Qwen's order, special or not), and
    their embedding rows (tied to the LM head): seeded random rows at the init scale, as untrained tokens have."""
    for content, special in QWEN3_5_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    trained = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(tokenizer.get_vocab_size(), mean_resizing=False)
    added = torch.randn(
        len(QWEN3_5_ADDED_TOKENS), model.config.hidden_size, generator=torch.Generator().manual_seed(SEED)
    )
    with torch.no_grad():
        model.get_input_embeddings().weight[trained:] = added * ADDED_EMBEDDING_STD


# ------------------------------------------------------------------------- saving


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    chat_template = CHAT_TEMPLATE_FILE.read_text()
    added = {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "add_bos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MODEL_MAX_LENGTH,
            "chat_template": chat_template,
        },
    )
    (out / "chat_template.jinja").write_text(chat_template)


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


# --------------------------------------------------------------------------- main


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
