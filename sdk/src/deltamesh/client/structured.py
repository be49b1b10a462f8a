"""Structured outputs as a client asks for them, in OpenAI's words (`response_format`) or vLLM's
(`structured_outputs`), made into the request's StructuredOutputs message. Only the shape is checked here; the
router and its workers check the rest (a schema, regex or grammar that does not parse is INVALID_ARGUMENT)."""

from __future__ import annotations

import json

from deltamesh.v1 import common_pb2

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_message(
    structured_outputs: dict | None, response_format: dict | None
) -> common_pb2.StructuredOutputs | None:
    """None when neither constrains the output; ValueError or TypeError for a shape neither API takes."""
    fmt_type = (response_format or {}).get("type", "text")
    if fmt_type not in ("text", "json_object", "json_schema"):
        raise ValueError(f"response_format type must be text, json_object or json_schema, got {fmt_type!r}")
    if fmt_type != "text" and structured_outputs is not None:
        raise ValueError("set response_format or structured_outputs, not both")
    if fmt_type == "json_object":
        return common_pb2.StructuredOutputs(json_object=True)
    if fmt_type == "json_schema":
        schema = ((response_format or {}).get("json_schema") or {}).get("schema")
        if schema is None:
            raise ValueError("response_format json_schema needs json_schema.schema")
        return common_pb2.StructuredOutputs(json_schema=json.dumps(schema))
    if structured_outputs is None:
        return None
    options = dict(structured_outputs)
    message = common_pb2.StructuredOutputs(disable_any_whitespace=bool(options.pop("disable_any_whitespace", False)))
    given = [k for k in _KINDS if options.get(k) not in (None, False)]
    unknown = sorted(set(options) - set(_KINDS))
    if unknown or len(given) != 1:
        raise ValueError(f"structured_outputs takes exactly one of {', '.join(_KINDS)} (got {sorted(options)})")
    kind = given[0]
    value = options[kind]
    if kind == "json":
        message.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        message.choice.SetInParent()  # an empty list is still a choice (which the router refuses, saying why)
        message.choice.choices.extend(value)
    else:
        setattr(message, kind, value)
    return message
