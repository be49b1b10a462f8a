"""What the benchmarks share: the exact command line, the date, a description of the machine, plain-text
tables, JSON results, free ports and child process groups."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from deltamesh.services.common.ports import free_port  # noqa: F401  (re-exported for the bench scripts)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "bench" / "configs"  # published model shapes, served with --load-format dummy
RESULTS = ROOT / "bench" / "results"  # where the scripts write their JSON by default (git-ignored)


def command_line() -> str:
    """The command as it was run (interpreter shown relative to the repo when it lives inside it)."""
    exe = Path(sys.executable)
    try:
        exe_s = str(exe.relative_to(Path.cwd()))
    except ValueError:
        exe_s = str(exe)
    return shlex.join([exe_s, *sys.argv])


def rel(path: str | Path) -> str:
    """A path relative to the repository when it lies inside it (results stay comparable across clones)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(path)


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git() -> dict[str, Any]:
    def run(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": run("rev-parse", "--short", "HEAD"), "dirty": bool(run("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total_gib": _mem_total_gib(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "git": _git(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda_device_count"] = torch.cuda.device_count()
    return info


def busy_warning(hint: str = "") -> str | None:
    """A warning when other work is using the CPUs (1-minute load average >= half the usable CPUs)."""
    if not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load < 0.5 * cpus:
        return None
    return f"WARNING: the machine is busy (load average {load:.2f} on {cpus} CPUs): timings are only indicative." + (
        f" {hint}" if hint else ""
    )


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def write_result(path: str | Path, payload: dict, machine: dict | None = None) -> Path:
    """A benchmark's JSON result: the exact command, the UTC date and the machine (`machine_info()` unless
    given), then `payload` (whose keys win), so that every file says how it was made."""
    return write_json(
        path, {"command": command_line(), "date_utc": utc_now(), "machine": machine or machine_info(), **payload}
    )


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def fmt(x: Any, digits: int = 3) -> str:
    """Numbers to at most `digits` significant decimals, large ones with thousands separators."""
    if isinstance(x, bool) or x is None:
        return "-" if x is None else str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != x:  # nan
            return "-"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) >= 100:
            return f"{x:.1f}"
        return f"{x:.{digits}g}"
    return str(x)


def ints(s: str) -> list[int]:
    """A comma-separated list of integers from the command line ("1,16,64")."""
    return [int(x) for x in s.split(",") if x.strip()]


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (aligned, so it also reads well in a terminal)."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_looks_numeric(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)) + " |"

    sep = "| " + " | ".join(("-" * (w - 1) + ":") if num else "-" * w for w, num in zip(widths, numeric)) + " |"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def print_table(rows: list[dict], cols: list[str]) -> None:
    """Result rows (dicts) as a table of the columns `cols`; a row without a column shows '-'."""
    print(table(cols, [[r.get(c) for c in cols] for r in rows]))


def _looks_numeric(s: str) -> bool:
    s = s.replace(",", "").replace(" ", "").rstrip("%xsBKMGiT")
    if s in ("-", ""):
        return True
    try:
        float(s)
        return True
    except ValueError:
        return False


def exit_on_sigterm() -> None:
    """`timeout` (scripts/gpu_stage.sh) ends a run with SIGTERM, whose default action skips every `finally`: exit
    through them instead, so that the meshes and simulations they stop (each in a process group of its own, which
    the signal does not reach) do not outlive the run and hold the GPU for the next one."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def stop_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Stop a child started with start_new_session=True and everything it started: SIGINT (a mesh shuts
    down cleanly on it), SIGKILL after `timeout` seconds. A group that is already gone is fine."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def decode_items(core, batch: int, context: int) -> list:
    """Scheduled decode items of an EngineCore: `batch` requests that already hold `context` tokens of
    (random) state, one new token each, with their pages and state slot allocated. Each request's new token
    differs: identical inputs would route every token of a MoE step to the same experts."""
    from deltamesh.engine import SamplingParams
    from deltamesh.engine.request import Request
    from deltamesh.engine.scheduler import ScheduledItem

    items = []
    for i in range(batch):
        req = Request(f"d{i}", [1] * context, SamplingParams(max_tokens=8, temperature=0), None)
        req.output_ids = [(7919 * i + 2) % core.model_config.vocab_size]
        req.num_computed = context
        req.slot = core.state_pool.alloc()
        req.pages = core.kv_pool.alloc(core.kv_pool.pages_for(context + 1))
        items.append(ScheduledItem(req, 1))
    return items


def prefill_items(core, batch: int, chunk: int) -> list:
    """Scheduled prefill items of an EngineCore: `batch` fresh requests, each prefilling a `chunk`-token prompt
    in one step, with their pages and state slot allocated (stepping them again recomputes the same chunk).
    The prompts' tokens differ, for the reason decode_items gives."""
    from deltamesh.engine import SamplingParams
    from deltamesh.engine.request import Request
    from deltamesh.engine.scheduler import ScheduledItem

    vocab = core.model_config.vocab_size
    items = []
    for i in range(batch):
        prompt = [3 + (7919 * i + j) % (vocab - 3) for j in range(chunk)]
        req = Request(f"p{i}", prompt, SamplingParams(max_tokens=8, temperature=0), None)
        req.slot = core.state_pool.alloc()
        req.pages = core.kv_pool.alloc(core.kv_pool.pages_for(chunk))
        items.append(ScheduledItem(req, chunk))
    return items


def with_tokenizer(shape: Path, work: Path) -> Path:
    """A model folder of the shape's config.json beside the default model's tokenizer files, for shapes kept as a
    config alone (bench/configs): a server reads a tokenizer at start, random-token loads need only a vocabulary
    and chat loads the template's special tokens."""
    from deltamesh.engine.defaults import DEFAULT_MODEL

    folder = work / f"with-tokenizer-{shape.name}"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(shape / "config.json", folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (DEFAULT_MODEL / name).is_file():
            shutil.copy(DEFAULT_MODEL / name, folder / name)
    return folder
