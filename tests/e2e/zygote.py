"""Mesh processes forked from a process that has imported torch and the services' libraries already.

A worker's start is mostly torch's import, and `make test` starts a few hundred mesh processes on 2 cores.
The harness asks one long-lived process per pytest worker, the zygote, to fork each mesh process instead:
the child shares the imported modules copy-on-write, then runs `python -m deltamesh.services.cli ARGS` as the
command line would (its own environment, log file and working directory), so the services run exactly the code
they run when started by hand. Only third-party libraries (and deltamesh's parent-death helper) are imported
before the fork: deltamesh's modules read settings from the environment as they load (failpoints, PDL), and
each child imports them with its own environment. The zygote starts no thread, event loop or gRPC object, so
nothing is half-held at a fork.

The zygote talks JSON lines: on its stdin {"argv", "env", "cwd", "log"} per process to start; on its stdout
{"pid"} for each start, in order, and {"exited", "code"} when a child ends (`code` as Popen's returncode:
negative for a signal). `ForkedProcess` gives the harness Popen's poll / wait / send_signal / kill on that.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

from deltamesh.services.supervisor import die_with_parent

PRELOADED = ("torch", "numpy", "grpc", "pydantic", "structlog", "typer", "fastapi", "uvicorn", "uvloop", "tokenizers")


def _run_child(spec: dict, closing: list[int]) -> None:
    """In the forked child: become `python -m deltamesh.services.cli ARGV` with the spec's environment."""
    import runpy

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in closing:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        die_with_parent(int(spec["zygote"]))  # nothing outlives a killed test run
        log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.chdir(spec["cwd"])
        os.environ.clear()
        os.environ.update(spec["env"])
        sys.argv = ["deltamesh.services.cli", *spec["argv"]]
        runpy.run_module("deltamesh.services.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve_forks() -> None:
    """The zygote's loop: fork on each request line, report each child's pid and, when it ends, its code."""
    die_with_parent(int(os.environ["DELTAMESH_ZYGOTE_PARENT"]))
    for name in PRELOADED:
        __import__(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wake-up pipe
    requests, replies = sys.stdin.fileno(), sys.stdout
    buffered, children = b"", set()

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    while True:
        ready, _, _ = select.select([requests, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if requests in ready:
            chunk = os.read(requests, 65536)
            if not chunk:  # the harness is gone: so are its processes
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                return
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                spec = {**json.loads(line), "zygote": os.getpid()}
                pid = os.fork()
                if pid == 0:
                    _run_child(spec, [wake_r, wake_w])  # its stdin and stdout are replaced
                children.add(pid)
                reply({"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


class ForkedProcess:
    """A mesh process the zygote forked, with the part of subprocess.Popen's interface the harness uses."""

    def __init__(self, zygote: Zygote, pid: int):
        self._zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._zygote.code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self._zygote.wait(self.pid, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended between the poll and the kill (not reaped yet)
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The harness's side: starts the zygote once, then forks mesh processes through it."""

    def __init__(self, root: Path):
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.e2e.zygote import serve_forks; serve_forks()"],
            cwd=root,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "DELTAMESH_ZYGOTE_PARENT": str(os.getpid())},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lock = threading.Condition()
        self._started: list[int] = []  # pids in the order of the requests, taken by start()
        self._codes: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="zygote-replies", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "pid" in message:
                    self._started.append(message["pid"])
                else:
                    self._codes[message["exited"]] = message["code"]
                self._lock.notify_all()
        with self._lock:  # the zygote is gone, and with it (parent-death signal) every child it had
            self._proc.wait()
            self._lock.notify_all()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess:
        with self._lock:
            self._proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}) + "\n")
            self._proc.stdin.flush()
            if not self._lock.wait_for(lambda: self._started or not self.alive(), timeout=60):
                raise RuntimeError("the zygote did not fork within 60 s")
            if not self._started:
                raise RuntimeError(f"the zygote exited with {self._proc.returncode}")
            return ForkedProcess(self, self._started.pop(0))

    def code(self, pid: int) -> int | None:
        with self._lock:
            if pid not in self._codes and not self.alive():
                return -signal.SIGKILL  # went with the zygote
            return self._codes.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int:
        with self._lock:
            if not self._lock.wait_for(lambda: pid in self._codes or not self.alive(), timeout=timeout):
                raise subprocess.TimeoutExpired(f"forked process {pid}", timeout)
        code = self.code(pid)
        assert code is not None
        return code


_zygote: Zygote | None = None


def zygote(root: Path) -> Zygote:
    """This pytest process's zygote, started on first use (again if it died)."""
    global _zygote
    if _zygote is None or not _zygote.alive():
        _zygote = Zygote(root)
    return _zygote
