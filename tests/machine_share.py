"""Tests that bound wall-clock times run alone; the others run side by side (pytest-xdist workers).

A reader-writer lock over two files in the session's temporary directory, which every xdist worker of one run
shares: each test holds `shared` from its setup to its teardown, a test marked `alone` holds `exclusive`. A
writer first takes the gate, so that no new test starts, then waits for the tests running to end: it waits for at
most one test per worker, never for the rest of the session."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class MachineShare:
    def __init__(self, directory: Path):
        self.gate = (directory / "machine-share.gate").open("a")
        self.running = (directory / "machine-share.running").open("a")

    @contextmanager
    def shared(self) -> Iterator[None]:
        fcntl.flock(self.gate, fcntl.LOCK_SH)  # not while a test that runs alone waits or runs
        fcntl.flock(self.running, fcntl.LOCK_SH)
        fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.running, fcntl.LOCK_UN)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.running, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.running, fcntl.LOCK_UN)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
