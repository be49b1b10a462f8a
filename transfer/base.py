"""What every transport shares: its errors, a pull's statistics, and the cut of two region lists into the
pieces a pull moves."""

from __future__ import annotations

from dataclasses import dataclass


class TransferError(RuntimeError):
    """A pull failed; `refused` is true when the holder refused it before moving bytes."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass
class TransferStats:
    nbytes: int
    buffers: int  # reads on the wire (segments)
    # perf_counter() at each step of the pull ("start", "keys": endpoint and keys looked up, "posted": every read
    # posted, "reads": every read done, "done": the lease word checked); on Linux that clock is CLOCK_MONOTONIC,
    # shared by the processes of one host, so they line up with a holder's timeline
    marks: dict[str, float]

    @property
    def seconds(self) -> float:
        return self.marks["done"] - self.marks["start"]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


def segments(src: list[int], dst: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Split two region lists of equal total size at every boundary of either:
    [(src_index, src_offset, dst_index, dst_offset, nbytes)]."""
    if sum(src) != sum(dst):
        raise TransferError(f"state sizes differ: holder {sum(src)} bytes, puller {sum(dst)} bytes", refused=True)
    out, i, j, si, dj = [], 0, 0, 0, 0
    while i < len(src) and j < len(dst):
        n = min(src[i] - si, dst[j] - dj)
        if n:
            out.append((i, si, j, dj, n))
        si, dj = si + n, dj + n
        if si == src[i]:
            i, si = i + 1, 0
        if dj == dst[j]:
            j, dj = j + 1, 0
    return out
