"""Command-line options made from settings models, and settings made back from the options' values: each setting's
name, type, default, help, flag and DELTAMESH_* variable is written once, on the model that owns it.

A field's option is --<name> (underscores as dashes) with the variable DELTAMESH_<NAME>, its help the field's
description (pydantic) or metadata["help"] (dataclass). The field's metadata (pydantic: json_schema_extra) may say
  flag: the option's name where it is not the field's (lease_ttl for lease_ttl_s)
  decls: typer's flag declarations, the option's own name included, where typer's are not wanted (a bool flag
    without a --no- form; vLLM's names beside deltamesh's: --page-size, --block-size)
  cli: False for a field that has no option
  prefix: on a field holding a nested model, put before the names of that model's options (tls_ for TlsSettings)
A nested model (pydantic model or dataclass) adds its fields' options; a list field is a repeatable option.

`deltamesh serve` hands each child its settings in the environment (SETTINGS_ENV, JSON): the fields serve set,
laid over what the child's own options and environment give."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

import typer
from pydantic import BaseModel, ValidationError

SETTINGS_ENV = "DELTAMESH_SETTINGS_JSON"
# the pid of the `serve` that handed the settings: only its own children take them, so a copy of the variable
# left in a shell never overrides the flags of a process started by hand
SETTINGS_PARENT_ENV = "DELTAMESH_SETTINGS_PARENT"
SECRETS = {"mesh_secret", "api_key"}  # never handed over in the settings: they travel in their own variables


@dataclass(frozen=True)
class Option:
    name: str  # the command's parameter: page_size is --page-size and DELTAMESH_PAGE_SIZE
    path: tuple[str, ...]  # the field it fills, e.g. ("engine", "page_size"); () for an option of no model
    annotation: Any
    default: Any
    help: str
    decls: tuple[str, ...] = ()

    def parameter(self) -> inspect.Parameter:
        option = typer.Option(*self.decls, help=self.help, envvar=f"DELTAMESH_{self.name.upper()}")
        return inspect.Parameter(
            self.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=self.default,
            annotation=Annotated[self.annotation, option],
        )


def options(model: type, *, exclude: tuple[str, ...] = (), prefix: str = "", path: tuple[str, ...] = ()) -> list:
    """The options of `model`'s fields (nested models' fields included), but those named in `exclude`."""
    found = []
    for name, annotation, default, meta in _fields(model):
        if meta.get("cli", True) is False:
            continue
        if _is_model(annotation):
            found += options(annotation, exclude=exclude, prefix=prefix + meta.get("prefix", ""), path=(*path, name))
            continue
        option_name = prefix + meta.get("flag", name)
        if option_name in exclude:
            continue
        cli_type, default = _cli_type(annotation, default)
        decls = tuple(meta.get("decls", ()))
        found.append(Option(option_name, (*path, name), cli_type, default, meta.get("help", ""), decls))
    return found


def merge(*groups: list[Option]) -> list[Option]:
    """One option per name, in order: the settings of several models that share an option (--host) share its value."""
    merged: dict[str, Option] = {}
    for option in (o for group in groups for o in group):
        merged.setdefault(option.name, option)
    return list(merged.values())


def with_options(*groups: list[Option]) -> Callable:
    """Give a command function (`def cmd(own params..., **values)`) the options of `groups` as parameters too;
    their values arrive in `values`."""

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]

        @functools.wraps(fn)
        def command(**values):
            return fn(**values)

        # typer reads the parameters from __signature__, which the type of functools.wraps' result does not declare
        command.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=own + [o.parameter() for o in merge(*groups)]
        )
        return command

    return decorate


def settings_from(model: type[BaseModel], opts: list[Option], values: dict, handed: dict | None = None, **fixed):
    """`model` from the values of its options (None: the field's default), then what `deltamesh serve` handed
    over laid on top, then `fixed`."""
    data: dict = {}
    for option in opts:
        value = values.get(option.name)
        if option.path and value is not None:
            node = data
            for key in option.path[:-1]:
                node = node.setdefault(key, {})
            node[option.path[-1]] = value
    _lay_over(data, handed or {})
    return model.model_validate({**data, **fixed})


def settings_problem(error: ValidationError, opts: list[Option]) -> str:
    """A settings model's first validation error as one line naming the option the user gave (`--grpc-port
    99999: input should be ...`); a check across fields (a model validator) says it all in its own words."""
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    message = str(cause) if isinstance(cause, ValueError) else first["msg"]
    message = message[:1].lower() + message[1:]
    flags = [o for o in opts if o.path == tuple(first["loc"])]
    if flags:
        return f"--{flags[0].name.replace('_', '-')} {first['input']}: {message}"
    return message if not first["loc"] else f"{'.'.join(map(str, first['loc']))}: {message}"


def hand_over(settings: BaseModel) -> dict[str, str]:
    """The environment entries that give a child of this process `settings`: the fields that were set, secrets
    left out, and who handed them."""
    return {
        SETTINGS_ENV: settings.model_dump_json(exclude_unset=True, exclude=SECRETS),
        SETTINGS_PARENT_ENV: str(os.getpid()),
    }


def started_by_serve() -> bool:
    """This process is a child of the `deltamesh serve` that handed it its settings (not of a copied shell)."""
    return os.environ.get(SETTINGS_PARENT_ENV) == str(os.getppid())


def handed_settings() -> dict:
    """What `deltamesh serve` handed this process: empty when started by hand, and when the variable was handed
    to a child of another process (then ignored, with a warning)."""
    handed = os.environ.get(SETTINGS_ENV)
    if not handed:
        return {}
    if not started_by_serve():
        print(
            f"deltamesh: ignoring {SETTINGS_ENV}: it was handed to a child of `deltamesh serve` (pid "
            f"{os.environ.get(SETTINGS_PARENT_ENV) or 'unknown'}), not to this process; its flags and "
            "DELTAMESH_* variables apply",
            file=sys.stderr,
        )
        return {}
    return json.loads(handed)


def _lay_over(data: dict, top: dict) -> None:
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            _lay_over(data[key], value)
        else:
            data[key] = value


def _fields(model: type):
    """(name, type, default, metadata) of each field of a pydantic model or a dataclass."""
    if dataclasses.is_dataclass(model):
        hints = typing.get_type_hints(model)
        for f in dataclasses.fields(model):
            default = None if f.default is dataclasses.MISSING else f.default
            yield f.name, hints[f.name], default, dict(f.metadata)
        return
    assert issubclass(model, BaseModel), model
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra  # our fields' are dicts (settings.py), never pydantic's callable form
        meta = dict(extra) if isinstance(extra, dict) else {}
        if info.description:
            meta["help"] = info.description
        default = None if info.is_required() or info.default_factory else info.default
        yield name, info.annotation, default, meta


def _is_model(annotation) -> bool:
    return inspect.isclass(annotation) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation))


def _cli_type(annotation, default):
    """The option's type and default for a field's: a Literal is a string (the model checks its values), a list
    a repeatable option that is None when not given."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return str, default
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return Optional[_cli_type(inner, default)[0]], default  # noqa: UP045  (built at run time for typer)
    if origin is list:
        return Optional[annotation], None  # noqa: UP045
    return annotation, default
