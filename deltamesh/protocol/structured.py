"""What a request's output must look like (structured outputs), as vLLM's StructuredOutputsParams says it: a JSON
schema, any JSON object, a regular expression, one of a list of strings, or a grammar (EBNF in xgrammar's dialect).
Torch-free: the gateway, the router and the engine share it; the engine compiles it (engine/grammar.py).

The checks here need no grammar library: exactly one kind, the right types, sizes within bounds. Whether a schema,
regex or grammar parses is the engine's check (xgrammar's parser), made when a worker takes the request in, before
it is queued."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# A spec travels with each of a request's choices to its workers and is compiled there: far above real schemas and
# tool lists (a few KiB), low enough that a request of many choices cannot flood its workers with it.
MAX_SPEC_BYTES = 256 << 10
MAX_CHOICES = 4096
# xgrammar's schema converter takes time cubic in a schema's nesting (measured: 32 levels of objects 8 ms, 128 levels
# 0.26 s, 900 levels 185 s), so a small schema could hold a worker's core for minutes. Real schemas nest a few levels;
# this counts JSON containers, two per level of properties.
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class StructuredOutputs:
    json: dict | None = None  # a JSON schema
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these
    grammar: str | None = None  # EBNF, xgrammar's dialect
    # vLLM's option: a JSON output (json, json_object) laid out as json.dumps writes it, one space after each , and :
    # and no other whitespace
    disable_any_whitespace: bool = False

    @property
    def kinds(self) -> list[str]:
        """The kinds given (validate checks there is exactly one)."""
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    @property
    def value(self):
        return getattr(self, self.kind)

    @cached_property
    def key(self) -> str:
        """The spec as one string: equal specs (and only those) compile to the same grammar. A schema keeps its
        keys' order: properties come out in the order the schema lists them."""
        return json.dumps([self.kind, self.value, self.disable_any_whitespace], ensure_ascii=False)

    def validate(self) -> None:
        """Raise ValueError with a message a user can act on."""
        kinds = self.kinds
        if len(kinds) != 1:
            named = ", ".join(kinds) if kinds else "none"
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)} (given: {named})")
        kind, value = self.kind, self.value
        if kind == "json" and not isinstance(value, dict):
            raise ValueError(f"a JSON schema must be a JSON object, got {type(value).__name__}")
        if kind == "json" and _depth(value) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels of objects and arrays")
        if kind == "json_object" and value is not True:
            raise ValueError("json_object must be true or absent")
        if kind in ("regex", "grammar") and not isinstance(value, str):
            raise ValueError(f"{kind} must be a string, got {type(value).__name__}")
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError("choice must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} choices, got {len(value)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("disable_any_whitespace must be true or false")
        try:
            size = len(self.key.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ValueError(f"the {kind} spec is not valid Unicode: a lone surrogate ({e.reason})") from None
        except (TypeError, ValueError, RecursionError) as e:  # a dict built in Python, or nested past JSON's depth
            raise ValueError(f"the {kind} spec is not JSON: {e}") from None
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"the {kind} spec has {size} bytes, over the limit of {MAX_SPEC_BYTES}")


def _depth(value) -> int:
    """How deep JSON objects and arrays nest in `value` (without recursion: a deep one is what is refused)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:
                todo += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest
