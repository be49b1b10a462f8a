"""The `deltamesh profile` and `deltamesh plan` commands (docs/planning.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from deltamesh.engine.engine_config import EngineConfig
from deltamesh.planner.profiler import Grid, Mixed
from deltamesh.services.common.options import options, with_options

# the profiled worker's settings, as `deltamesh serve` takes them; its pools are sized for the measurements
PROFILED = options(EngineConfig, exclude=("max_num_seqs", "num_kv_pages", "handoff_states"))


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=flag) from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"expected integers >= 1, got {text!r}", param_hint=flag)
    return values


def _fail(command: str, error: Exception) -> typer.Exit:
    print(f"deltamesh {command}: {error}", file=sys.stderr)
    return typer.Exit(2)


def _defaults(field: str) -> str:
    """What the profiler measures unless told, on a GPU and on CPU (profiler.Grid.default)."""

    def show(value) -> str:
        if isinstance(value, list):
            return ",".join(
                f"{m.decodes}:{m.context}:{m.prompts}:{m.prompt_len}" if isinstance(m, Mixed) else str(m) for m in value
            )
        return str(value)

    return f"default: GPU {show(getattr(Grid.default(True), field))}; CPU {show(getattr(Grid.default(False), field))}"


def _ints_option(what: str, field: str) -> Any:
    """The typer option of a comma-separated list of integers (the metadata of its Annotated[str | None, ...])."""
    return typer.Option(help=f"{what}, comma-separated ({_defaults(field)})")


@with_options(PROFILED)
def profile(
    out: Annotated[str | None, typer.Option(help="Profile JSON (default: PROFILE-NAME.json)")] = None,
    name: Annotated[str | None, typer.Option(help="Label (default: MODEL-DEVICE[-tpN])")] = None,
    prefill_lens: Annotated[str | None, _ints_option("Prompt lengths of the prefill points", "prefill_lens")] = None,
    prefill_batches: Annotated[str | None, _ints_option("Prompts prefilled together", "prefill_batches")] = None,
    decode_batches: Annotated[str | None, _ints_option("Decode batches", "decode_batches")] = None,
    decode_contexts: Annotated[str | None, _ints_option("Decode contexts", "decode_contexts")] = None,
    decode_steps: Annotated[
        int | None, typer.Option(help=f"Timed decode steps per point ({_defaults('decode_steps')})")
    ] = None,
    mixed: Annotated[
        str | None,
        typer.Option(
            help=f"Mixed steps: DECODES:CONTEXT:PROMPTS:PROMPT_LEN, comma-separated, '' for none ({_defaults('mixed')})"
        ),
    ] = None,
    reps: Annotated[int | None, typer.Option(help=f"Rounds of every point, medians ({_defaults('reps')})")] = None,
    transfer_lens: Annotated[str | None, _ints_option("Prompt lengths of the transfer points", "transfer_lens")] = None,
    transfer_from: Annotated[
        str | None,
        typer.Option(help="Take the transfer times from a bench/transfer.py JSON (or a profile)"),
    ] = None,
    transfer: Annotated[bool, typer.Option(help="Measure state transfers (bench/transfer.py)")] = True,
    ucx_error_handling: Annotated[bool, typer.Option(help="The transfers' UCX mode, as the workers' flag")] = True,
    **values,
) -> None:
    """Measure what one worker of a model and parallelism costs on this machine (prefill, decode, mixed steps,
    state transfers, memory) and write it as a profile for `deltamesh plan`."""
    from deltamesh.planner import transfer_times
    from deltamesh.planner.profile import ProfileError, TransferModel
    from deltamesh.planner.profiler import MeasurementError, run_profile

    engine = EngineConfig(**{o.path[-1]: values[o.name] for o in PROFILED if values.get(o.name) is not None})
    try:
        engine.validate()
        grid = Grid.default(engine.device.startswith("cuda"))
        for field_name, text in (
            ("prefill_lens", prefill_lens),
            ("prefill_batches", prefill_batches),
            ("decode_batches", decode_batches),
            ("decode_contexts", decode_contexts),
            ("transfer_lens", transfer_lens),
        ):
            given = _ints(text, "--" + field_name.replace("_", "-"))
            if given is not None:
                setattr(grid, field_name, given)
        if decode_steps is not None:
            grid.decode_steps = decode_steps
        if reps is not None:
            grid.reps = reps
        if mixed is not None:
            grid.mixed = [Mixed.parse(s) for s in mixed.split(",") if s.strip()]
        grid.check()
        label = name or _label(engine)
        path = Path(out or f"{label}.json")
        if transfer_from:
            moves = transfer_times.from_file(transfer_from)
        elif transfer:
            moves = transfer_times.measure(
                engine.model,
                grid.transfer_lens,
                str(engine.torch_dtype()).removeprefix("torch."),
                engine.state_dtype,
                engine.device.startswith("cuda"),
                ucx_error_handling,
                max(2, grid.reps),
            )
        else:
            moves = TransferModel([], "not measured (--no-transfer)")
        result = run_profile(engine, grid, moves, label)
    except (ValueError, ProfileError, MeasurementError) as e:
        raise _fail("profile", e) from None
    given_options = dict(
        values,
        out=out,
        name=name,
        prefill_lens=prefill_lens,
        prefill_batches=prefill_batches,
        decode_batches=decode_batches,
        decode_contexts=decode_contexts,
        decode_steps=decode_steps,
        mixed=mixed,
        reps=reps,
        transfer_lens=transfer_lens,
        transfer_from=transfer_from,
        transfer=transfer,
        ucx_error_handling=ucx_error_handling,
    )
    result.provenance = {"command": _command_line(profile, given_options), **_provenance()}
    result.save(path)
    print(f"deltamesh profile: wrote {path}", file=sys.stderr)
    print(_profile_summary(result))


def _label(engine: EngineConfig) -> str:
    device = "cpu" if engine.device == "cpu" else "cuda"
    par = f"-tp{engine.tensor_parallel_size}" if engine.tensor_parallel_size > 1 else ""
    par += f"-dp{engine.data_parallel_size}" if engine.data_parallel_size > 1 else ""
    return f"{Path(engine.model).resolve().name}-{device}{par}"


def _provenance() -> dict:
    import datetime
    import os
    import platform
    import subprocess

    import torch

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    machine = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        machine |= {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda}
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
        "machine": machine,
        "tree": {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain"))},
    }


def _command_line(command, given: dict) -> str:
    """`deltamesh NAME` with the options whose values are not their defaults: the command that repeats this one."""
    import inspect
    import shlex

    words = ["deltamesh", command.__name__]
    for name, param in inspect.signature(command).parameters.items():
        value = given.get(name, param.default)
        if value == param.default:
            continue
        flag = name.replace("_", "-")
        words += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return shlex.join(words)


def _profile_summary(p) -> str:
    from deltamesh.planner.report import table

    pre = p.prefill
    lines = [
        f"{p.describe()}: prefill step {pre.step_ms:.2f} ms + {pre.ms_per_token * 1e3:.2f} ms per 1k tokens + "
        f"{pre.ms_per_mpair:.3f} ms per million attention pairs (fit errors "
        f"{', '.join(f'{e:+.0%}' for e in p.fit_errors.get('prefill', []))}); mixed step extra "
        f"{p.mixed_extra_ms:+.2f} ms",
        table(
            ["decode batch", "context", "step ms"],
            [[str(int(b)), str(int(c)), f"{ms:.2f}"] for b, c, ms in p.decode.points],
        ),
        f"KV {p.memory.kv_bytes_per_token} B/token, state {p.memory.state_bytes / 2**20:.1f} MiB/request, weights "
        f"{p.memory.weights_bytes / 2**30:.2f} GiB; transfers: "
        + (", ".join(f"{int(t)} tokens {ms:.2f} ms" for t, ms in p.transfer.points) or p.transfer.source),
    ]
    return "\n".join(lines)


def plan(
    profile: Annotated[
        list[str],
        typer.Option(help="A profile (deltamesh profile); repeat it for each parallelism to weigh"),
    ],
    input_len: Annotated[
        str, typer.Option(help="Prompt tokens: N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA, file:PATH")
    ],
    output_len: Annotated[str, typer.Option(help="Output tokens, as --input-len")],
    request_rate: Annotated[float | None, typer.Option(help="Requests per second (open loop)")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Requests kept in flight (closed loop)")] = None,
    burstiness: Annotated[float, typer.Option(help="Arrival gaps' gamma shape: 1 Poisson, inf evenly spaced")] = 1.0,
    num_requests: Annotated[int, typer.Option(help="Requests simulated per layout")] = 400,
    seed: Annotated[int, typer.Option(help="Seed of the lengths and arrivals")] = 0,
    ttft_p50: Annotated[float | None, typer.Option(help="SLA: median TTFT, ms")] = None,
    ttft_p90: Annotated[float | None, typer.Option(help="SLA: 90th percentile TTFT, ms")] = None,
    tpot: Annotated[float | None, typer.Option(help="SLA: median TPOT, ms")] = None,
    tpot_p90: Annotated[float | None, typer.Option(help="SLA: 90th percentile TPOT, ms")] = None,
    max_gpus: Annotated[int, typer.Option(help="Most GPUs (CPU: worker processes) a layout may use")] = 8,
    max_num_seqs: Annotated[str | None, typer.Option(help="Per-worker batch limits to weigh, comma-separated")] = None,
    max_num_batched_tokens: Annotated[str | None, typer.Option(help="Step budgets to weigh, comma-separated")] = None,
    transfer: Annotated[
        str | None,
        typer.Option(help="State-transfer times for every profile: a bench/transfer.py JSON or a profile"),
    ] = None,
    colocated_only: Annotated[bool, typer.Option(help="Weigh colocated layouts only")] = False,
    disaggregated_only: Annotated[bool, typer.Option(help="Weigh prefill/decode layouts only")] = False,
    path_ms: Annotated[
        float,
        typer.Option(
            help="The serving path's time each way (REST gateway, router, network), ms: a request reaches its "
            "worker this long after it is sent and its tokens the client this long after they are made "
            "(bench/plan_check.py measures it)"
        ),
    ] = 0.0,
    top: Annotated[int, typer.Option(help="Layouts in the table")] = 10,
    json_out: Annotated[str | None, typer.Option("--json", help="Also write the plan as JSON here")] = None,
) -> None:
    """Find the best colocated and prefill/decode layouts for a traffic and SLAs from profiles, by simulating
    the router, the workers' queues and their engine steps; print them and the commands that deploy the winner."""
    from deltamesh.planner import report, transfer_times
    from deltamesh.planner.profile import Profile, ProfileError
    from deltamesh.planner.search import Planner
    from deltamesh.planner.simulator import SimulationError
    from deltamesh.planner.traffic import LengthDist, Sla, Traffic

    try:
        profiles = [Profile.load(p) for p in profile]
        if transfer:
            moves = transfer_times.from_file(transfer)
            for p in profiles:
                p.transfer = moves
        traffic = Traffic(
            LengthDist.parse(input_len),
            LengthDist.parse(output_len),
            request_rate,
            concurrency,
            num_requests,
            burstiness,
            seed,
        )
        sla = Sla(ttft_p50, ttft_p90, tpot, tpot_p90)
        if colocated_only and disaggregated_only:
            raise ValueError("--colocated-only and --disaggregated-only exclude each other")
        result = Planner(
            profiles,
            traffic,
            sla,
            max_gpus,
            _ints(max_num_seqs, "--max-num-seqs"),
            _ints(max_num_batched_tokens, "--max-num-batched-tokens"),
            disaggregated_only,
            colocated_only,
            path_ms,
        ).run()
    except (ValueError, ProfileError, SimulationError) as e:
        raise _fail("plan", e) from None
    print(report.render(result, top))
    if json_out:
        Path(json_out).write_text(json.dumps(report.to_json(result), indent=2) + "\n")
