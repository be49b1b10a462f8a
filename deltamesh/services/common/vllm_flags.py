"""`vllm serve`'s command line as `deltamesh serve` reads it, so that a model card's vLLM command runs with
`vllm serve` replaced: the model as a positional argument, several names after one --served-model-name, and the flags
deltamesh honours by design (VllmFlags), each accepted with help saying why it changes nothing here and refused in
one line where its value asks for what deltamesh does not do. vLLM's names for settings deltamesh has under names of
its own (--port, --block-size, --enable-prefix-caching, --enforce-eager) are those settings' flags too (their
`decls`, options.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic.json_schema import JsonDict

MODEL_ARGUMENT_HELP = "Hugging Face checkpoint directory, as `vllm serve MODEL` takes it (or --model)"


def _switch(flag: str) -> JsonDict:
    """A flag with no --no- form, as vLLM spells it."""
    return {"decls": [flag]}


class VllmFlags(BaseModel):
    enable_auto_tool_choice: bool = Field(
        False,
        description="Accepted, as vLLM needs it for tool calls: deltamesh reads tool calls out of the reply to every "
        "request with tools (unless its tool_choice is none), as --tool-call-parser says",
        json_schema_extra=_switch("--enable-auto-tool-choice"),
    )
    trust_remote_code: bool = Field(
        False,
        description="Accepted: the model families served here are implemented in deltamesh itself, so no code from "
        "the checkpoint runs",
        json_schema_extra=_switch("--trust-remote-code"),
    )
    language_model_only: bool = Field(
        False,
        description="Accepted: only the language model is served (a checkpoint's vision weights are never loaded)",
        json_schema_extra=_switch("--language-model-only"),
    )
    disable_custom_all_reduce: bool = Field(
        False,
        description="Accepted: tensor-parallel ranks all-reduce through torch.distributed (NCCL); there is no custom "
        "all-reduce to turn off",
        json_schema_extra=_switch("--disable-custom-all-reduce"),
    )
    enable_chunked_prefill: bool = Field(
        True,
        description="Always on: a prompt longer than --max-num-batched-tokens is prefilled in chunks of that many "
        "tokens (--no-enable-chunked-prefill is refused)",
    )
    kv_cache_dtype: str = Field("auto", description="auto only: the KV cache is kept in the model's dtype (--dtype)")
    disable_uvicorn_access_log: bool = Field(
        False,
        description="Accepted: the REST gateway keeps no access log (each request's line is the router's "
        "`request` log line: --disable-log-requests)",
        json_schema_extra=_switch("--disable-uvicorn-access-log"),
    )
    tokenizer: str | None = Field(
        None, description="The checkpoint directory only: the tokenizer is read from the served checkpoint"
    )
    pipeline_parallel_size: int = Field(
        1, description="1 only: a worker splits its model by tensor (and expert) parallelism, not by pipeline stages"
    )
    distributed_executor_backend: str | None = Field(
        None, description="mp (or uni, or unset): each tensor-parallel rank is a process of its own; ray is refused"
    )
    mm_encoder_tp_mode: str | None = Field(
        None, description="Accepted: only the language model is served, so there is no vision encoder to split"
    )
    limit_mm_per_prompt: str | None = Field(
        None,
        description='Accepted with 0 of every modality (JSON, e.g. \'{"image": 0, "video": 0}\'): only text is served',
    )

    @field_validator("pipeline_parallel_size")
    @classmethod
    def _one_stage(cls, size: int) -> int:
        if size != 1:
            raise ValueError(
                "deltamesh splits a model by tensor and expert parallelism (--tensor-parallel-size, "
                "--enable-expert-parallel), not by pipeline stages: only 1 is accepted"
            )
        return size

    @field_validator("distributed_executor_backend")
    @classmethod
    def _processes(cls, backend: str | None) -> str | None:
        if backend not in (None, "mp", "uni"):
            raise ValueError(
                "each tensor-parallel rank runs as a process that `deltamesh serve` starts on this host "
                "(torch.distributed): mp or uni only"
            )
        return backend

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _text_only(cls, limits: str | None) -> str | None:
        if limits is None:
            return limits
        try:
            counts = json.loads(limits)
        except ValueError as e:
            raise ValueError(f"not JSON: {e}") from None
        # a modality's limit: a count, or (vLLM's newer form) an object with its count
        limits_of = (
            [n.get("count") if isinstance(n, dict) else n for n in counts.values()] if isinstance(counts, dict) else [1]
        )
        if any(n != 0 for n in limits_of):
            raise ValueError(
                "deltamesh serves text only (no images, videos or audio are read): each modality's limit must be 0"
            )
        return limits

    @field_validator("kv_cache_dtype")
    @classmethod
    def _model_dtype(cls, dtype: str) -> str:
        if dtype != "auto":
            raise ValueError("the KV cache is kept in the model's dtype (--dtype); only auto is accepted")
        return dtype

    @model_validator(mode="after")
    def _chunked_prefill(self) -> VllmFlags:
        # refused here, naming the flag the user gave (a field's error would read --enable-chunked-prefill False)
        if not self.enable_chunked_prefill:
            raise ValueError(
                "--no-enable-chunked-prefill: deltamesh always prefills a long prompt in chunks of "
                "--max-num-batched-tokens tokens; leave the flag out"
            )
        return self


def served_model(ctx: typer.Context, argument: str | None, option: str) -> str:
    """The checkpoint `serve` serves: vLLM's positional MODEL, else --model. MODEL overrides $DELTAMESH_MODEL, as a
    command line overrides the environment; MODEL and a --model naming another checkpoint are a usage error rather
    than one of them silently winning. So is vLLM's --tokenizer naming another directory: the tokenizer and chat
    template are the checkpoint's."""
    model = option
    if argument is not None:
        source = ctx.get_parameter_source("model")  # typer's own click's enum: known by its name
        if source is not None and source.name == "COMMANDLINE" and Path(option).resolve() != Path(argument).resolve():
            raise typer.BadParameter(
                f"{argument} and --model {option} name two checkpoints: give one", param_hint="MODEL / --model"
            )
        model = argument
    tokenizer = ctx.params.get("tokenizer")
    if tokenizer is not None and Path(tokenizer).resolve() != Path(model).resolve():
        raise typer.BadParameter(
            f"{tokenizer}: the tokenizer and chat template are read from the checkpoint directory ({model}); leave "
            "the flag out, or serve a checkpoint directory that holds the tokenizer to use",
            param_hint="--tokenizer",
        )
    return model


def one_flag_per_value(argv: list[str], flag: str) -> list[str]:
    """`flag a b c` as `flag a flag b flag c`: vLLM takes several values after one flag (nargs="+"), click takes
    a repeated flag."""
    out: list[str] = []
    after_flag = False
    for arg in argv:
        if after_flag and not arg.startswith("-"):
            out += [arg] if out[-1] == flag else [flag, arg]
            continue
        after_flag = arg == flag
        out.append(arg)
    return out
