"""The default model's training text and tokenizer (scripts/make_default_model.py): CPython's own pydoc topics and
stdlib docstrings, every third docstring as a ChatML exchange, every 50th document held out; a byte-level BPE
tokenizer with Qwen3.5's pre-tokeniser, trained on them."""

from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path
from pydoc_data.topics import topics as PYDOC_TOPICS

import jinja2
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Data.
SKIPPED_STDLIB_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
MIN_WORDS = 4
CHAT_EVERY = 3
VAL_EVERY = 50

# Tokenizer.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
VOCAB_SIZE = 4096
# Qwen3.5's pre-tokenisation regex (transformers' tokenization_qwen3_5.py).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# The training data's chat exchanges (plain ChatML); the served template is scripts/default_model_format.py's
# CHAT_TEMPLATE_FILE.
TRAINING_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


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
