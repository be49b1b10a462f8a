"""Parameters that OpenAI's API or vLLM's extensions define and deltamesh does not implement. Clients that send
every field of their request type send them at their defaults (or null), so those pass; any other value is refused
with 400 naming the parameter, since quietly ignoring it would change what the client asked for."""

from __future__ import annotations

from typing import Any

from deltamesh.services.router.limits import InvalidParam

# name -> (its default, advice for whoever sets it, or "")
BOTH: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, ""),
    "length_penalty": (1.0, "it applies to beam search, which is not served here"),
    "priority": (0, "priority scheduling is not enabled (as vLLM without --scheduling-policy priority)"),
    "bad_words": ([], "logit_bias can ban single tokens"),
    "allowed_token_ids": (None, "structured_outputs can restrict the output"),
    "cache_salt": (None, ""),
    "kv_transfer_params": (None, "deltamesh moves states between its own workers"),
    "vllm_xargs": (None, ""),
    "logits_processors": (None, ""),
    "thinking_token_budget": (None, ""),
    "return_tokens_as_token_ids": (False, ""),
    "repetition_detection": (None, ""),
}
COMPLETIONS: dict[str, tuple[Any, str]] = {**BOTH, "prompt_embeds": (None, "")}
CHAT: dict[str, tuple[Any, str]] = {
    **BOTH,
    "echo": (False, ""),
    "chat_template": (
        None,
        "the server's template is used: the checkpoint's, or the router's --chat-template (as vLLM without "
        "--trust-request-chat-template)",
    ),
    "documents": (None, ""),
    "mm_processor_kwargs": (None, "the models served here take text only"),
    "media_io_kwargs": (None, "the models served here take text only"),
    "modalities": (["text"], "the models served here answer in text only"),
    "audio": (None, "the models served here answer in text only"),
    "prediction": (None, ""),
    "web_search_options": (None, ""),
    "verbosity": (None, ""),
    "functions": (None, "use tools, OpenAI's replacement for functions"),
    "function_call": (None, "use tool_choice, OpenAI's replacement for function_call"),
}


def at_defaults_only(data: Any, table: dict[str, tuple[Any, str]]) -> Any:
    """`data` (a request's JSON object) without the parameters of `table` that are null or at their default;
    InvalidParam for the first one that is not."""
    if not isinstance(data, dict) or not any(name in table for name in data):
        return data
    kept = {}
    for name, value in data.items():
        if name not in table:
            kept[name] = value
            continue
        default, advice = table[name]
        if value is not None and value != default:
            why = f": {advice}" if advice else ""
            raise InvalidParam(name, f"{name} is not supported here; leave it out or at {default!r}{why}")
    return kept
