"""Values of Qwen3.5's XML-style tool calls (`<parameter=NAME>\\nVALUE\\n</parameter>`) are bare text: each is
read as the type the tool's JSON schema gives the parameter, as vLLM's qwen3_coder parser reads it (a value that
does not read as its type stays text; a parameter the schema does not name stays text)."""

from __future__ import annotations

import ast
import json
from typing import Any

_NULLS = ("null", "none")  # the template writes a None argument as Python's `None`
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_UNREADABLE = (ValueError, TypeError, SyntaxError, RecursionError, MemoryError)


def _types(schema: dict) -> list[str]:
    """The schema's types, in order: `type` (a name or a list of names), else those of its anyOf / oneOf options."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared.strip().lower()]
    if isinstance(declared, list):
        return [str(t).strip().lower() for t in declared]
    options = schema.get("anyOf") or schema.get("oneOf") or []
    return [t for option in options if isinstance(option, dict) for t in _types(option)]


def _structured(value: str) -> Any:
    """A JSON value, else a Python literal (a model may write a dict as Python prints it), else None."""
    try:
        return json.loads(value)
    except _UNREADABLE:
        pass
    try:
        return ast.literal_eval(value)  # literals only: never runs code
    except _UNREADABLE:
        return None


def convert(value: str, schema: Any) -> Any:
    converted = _convert(value, schema)
    try:  # what the arguments' JSON can carry (a Python literal may be a set; a number may be inf)
        json.dumps(converted, allow_nan=False)
    except _UNREADABLE:
        return value
    return converted


def _convert(value: str, schema: Any) -> Any:
    if not isinstance(schema, dict):
        return value  # a parameter the tool does not declare
    types = _types(schema)
    main = next((t for t in types if t != "null"), "string" if not types else "null")
    if value.strip().lower() in _NULLS and ("null" in types or main not in _STRING_TYPES):
        return None
    if main in _STRING_TYPES:
        return value
    text = value.strip()
    if main.startswith(("int", "uint", "long", "short")):
        try:
            return int(text)
        except ValueError:
            return value
    if main.startswith(("num", "float", "double")):
        try:
            number = float(text)
        except ValueError:
            return value
        return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    if main in ("boolean", "bool"):
        return {"true": True, "false": False}.get(text.lower(), value)
    if main in ("object", "array") or main.startswith(("dict", "list")):
        parsed = _structured(text)
        return parsed if isinstance(parsed, (dict, list)) else value
    parsed = _structured(text)
    return value if parsed is None else parsed
