"""Process supervision for `deltamesh serve`: start the mesh's processes, restart any that exits while the mesh
is not stopping, and stop them all on SIGINT/SIGTERM.

A crashed worker is restarted with the same command line and environment (where `serve` hands it its settings),
so it comes back on the same gRPC and metrics ports and the router's registry entry (keyed by address) stays valid;
the other processes keep serving meanwhile.
A process that cannot start at all (a bad flag, a port in use) is not retried forever: after
MAX_START_FAILURES quick exits in a row the supervisor gives up and stops the mesh; at once when it exits with
CONFIG_ERROR (a model directory or device this machine cannot serve: no retry would change that)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from deltamesh.services.common.logs import write_line

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # up this long: the next crash starts the back-off from the beginning again
START_WINDOW_S = 15.0  # an exit this soon after starting counts as a failure to start (imports + model load)
MAX_START_FAILURES = 5
CONFIG_ERROR = 78  # the exit status of a process whose configuration cannot be served (sysexits' EX_CONFIG)
STOP_DEADLINE_S = 10.0  # SIGTERM, then SIGKILL for whatever is still running after this long
POLL_S = 0.1


@dataclass
class ChildSpec:
    """One process of the mesh. `env` is its whole environment: what every child needs (e.g. a per-mesh
    secret) is one more entry where the specs are built."""

    name: str  # e.g. "router", "decode-1": what the logs call it
    argv: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (router processes' shared counts)


@dataclass
class Child:
    spec: ChildSpec
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff_s: float = BACKOFF_FIRST_S
    start_failures: int = 0  # quick exits in a row
    restart_at: float | None = None  # when a dead child is due to start again
    restarts: int = 0


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """In a child of `deltamesh serve`: get SIGTERM (a graceful stop) when serve goes, however it goes, SIGKILL
    included, so that no worker outlives it holding its ports (Linux's parent-death signal). If serve is gone
    already, stop now.

    A stopped child (SIGSTOP, a debugger) cannot act on that SIGTERM until it runs again, so serve starts each
    child in a process group of its own (Supervisor._start): when serve dies, the group is orphaned, and the kernel
    sends an orphaned group that holds a stopped process SIGHUP and SIGCONT, which stop the child too (services
    stop gracefully on SIGHUP as on SIGTERM). Out of serve's group, a child that writes to the terminal with
    `stty tostop` would be stopped by SIGTTOU: it is ignored, so the write goes through as it did in serve's group."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def exit_without_teardown(code: int) -> None:
    """End a process whose shutdown is done (its servers, engine, transport or children closed in order) without
    the interpreter's teardown: its garbage collection of grpc.aio's objects (channels, servers, the completion
    queue's poller) and of torch's took 2-7 s per process on a loaded 2-core machine, so that Ctrl-C on `deltamesh
    serve` took 7-12 s. atexit handlers still run, and the standard streams are flushed."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def log(message: str) -> None:
    write_line(sys.stderr, f"deltamesh: {message}")


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class Supervisor:
    def __init__(self, specs: list[ChildSpec]):
        self.children = [Child(spec) for spec in specs]
        self.stopping = False
        self.kill_now = False
        self.gave_up = False  # a child could not be started

    def run(self) -> int:
        """Start every child and keep them running until SIGINT/SIGTERM (exit code 0) or until a child keeps
        failing to start (non-zero)."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        for child in self.children:
            self._start(child)
        while not self.stopping:
            now = time.monotonic()
            for child in self.children:
                self._tend(child, now)
            time.sleep(POLL_S)
        self._stop_all()
        return 1 if self.gave_up else 0

    def _on_signal(self, signum, _frame) -> None:
        if self.stopping:  # a second Ctrl-C: do not wait for the children's graceful shutdown
            self.kill_now = True
            return
        log(f"{signal.Signals(signum).name}: stopping the mesh")
        self.stopping = True

    def _start(self, child: Child) -> None:
        # a group of its own: orphaned when serve dies, so that the kernel wakes the child if it is stopped (see
        # die_with_parent); the terminal's Ctrl-C reaches serve only, which stops the children in order
        child.popen = subprocess.Popen(
            child.spec.argv, env=child.spec.env, process_group=0, pass_fds=child.spec.pass_fds
        )
        child.started_at = time.monotonic()
        child.restart_at = None

    def _tend(self, child: Child, now: float) -> None:
        """Notice a child's exit and restart it when its back-off has passed."""
        if child.popen is not None:
            returncode = child.popen.poll()
            if returncode is None:
                if now - child.started_at >= STABLE_S:  # has proven it can run: forget earlier failures
                    child.backoff_s, child.start_failures = BACKOFF_FIRST_S, 0
                return
            self._exited(child, returncode, now)
        if not self.stopping and child.restart_at is not None and now >= child.restart_at:
            child.restarts += 1
            log(f"restarting {child.spec.name} (restart {child.restarts})")
            self._start(child)

    def _exited(self, child: Child, returncode: int, now: float) -> None:
        up_s = now - child.started_at
        child.popen = None
        child.start_failures = child.start_failures + 1 if up_s < START_WINDOW_S else 0
        if returncode == CONFIG_ERROR:
            log(f"{child.spec.name} cannot serve this configuration (its error above); stopping the mesh")
            self.gave_up = True
            self.stopping = True
            return
        # one that cannot start at all (a bad flag, a port in use) would only crash-loop: give up on the mesh
        if child.start_failures >= MAX_START_FAILURES:
            log(
                f"{child.spec.name} {describe_exit(returncode)} {child.start_failures} times in a row within "
                f"{START_WINDOW_S:g} s of starting; giving up and stopping the mesh"
            )
            self.gave_up = True
            self.stopping = True
            return
        child.restart_at = now + child.backoff_s
        log(f"{child.spec.name} {describe_exit(returncode)} after {up_s:.1f} s; restarting in {child.backoff_s:g} s")
        child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)

    def _stop_all(self) -> None:
        """SIGTERM every child (they shut down gracefully, in parallel), SIGKILL those still running at the
        deadline or at once on a second SIGINT/SIGTERM."""
        running = [(c, c.popen) for c in self.children if c.popen is not None and c.popen.poll() is None]
        for _, popen in running:
            popen.send_signal(signal.SIGTERM)
        started = time.monotonic()
        deadline = started + STOP_DEADLINE_S
        waiting = list(running)
        while waiting and time.monotonic() < deadline and not self.kill_now:
            time.sleep(POLL_S / 2)
            for child, popen in [(c, p) for c, p in waiting if p.poll() is not None]:
                waiting.remove((child, popen))
                log(f"{child.spec.name} stopped after {time.monotonic() - started:.1f} s")
        for child, popen in running:
            if popen.poll() is None:
                log(f"killing {child.spec.name} (pid {popen.pid}): still running")
                popen.kill()
            popen.wait()
