"""Qwen3.5's format on the default model, added after training (scripts/make_default_model.py): the rest of
Qwen3.5's added tokens and their embedding rows, and the tokenizer's files with the served chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer
from transformers import Qwen3_5ForCausalLM

from scripts.default_model_data import ENDOFTEXT, IM_END
from scripts.default_model_training import SEED

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
CHAT_TEMPLATE_FILE = Path(__file__).with_name("deltamesh_tiny_chat_template.jinja")
MODEL_MAX_LENGTH = 4096


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
