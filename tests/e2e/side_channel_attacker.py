"""An attacker on the UCX side channel (tests/e2e/test_side_channel_attacks.py): a process of its own, started as
another user where the test can, with a UCX worker of its own, trying to read a worker's memory and to send it
junk, as the security review of 2026-12-04 did.

    python tests/e2e/side_channel_attacker.py PLAN_JSON    (one JSON line on stdout: what each attempt got)

PLAN_JSON:
  user: [uid, gid] to become before UCX starts (the test runs as root: the interpreter may live where another
      user cannot read it, so the process starts as root, loads what it needs, then drops to that user for good)
  ucx_env: UCX_* variables this process sets before UCX starts (the transports it offers)
  error_handling: UCX peer error handling on its endpoints (off by default: UCX then allows every transport)
  timeout_s: per read
  attempts: [{name, forge_port | address, reads, junk}], each at one target:
      forge_port: a TCP port, reached by forging a UCX worker address: this process's own, with its TCP
          listener's port swapped for this one (what `ss -ltn` shows anyone) and another worker id
      address: a UCX worker address (hex) given whole, e.g. leaked from a lease
      reads: [{name, address, nbytes, rkey (hex; absent: a key for this process's own memory)}], in order
      junk: then send a malformed and an oversized message on the holders' notice tag
  hold: bytes (hex) to put in registered memory of this process instead of attacking: it prints its worker's
      address, where the bytes are and their key, then serves UCX until its stdin closes (an insider's "lease word")

Each result names its attempt and read ("junk" for the messages) and an outcome: "read" (with the bytes, hex),
"sent", "error", "timeout", "unreachable" (no endpoint), or "no-forge" (no TCP listener of its own to forge from).
The process exits without closing its endpoints (a peer that died mid-read would hold up UCX's teardown)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import struct
import sys
import time

NOTICE_TAG = 0x646D_7368_0000_0001  # deltamesh/transfer/ucx/notices.py (not imported: a public constant anyway)


def _own_tcp_ports() -> set[int]:
    """The TCP ports this process listens on (its UCX worker's TCP interface)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if m := re.fullmatch(r"socket:\[(\d+)\]", link):
            inodes.add(m.group(1))
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _forge(own: bytes, port: int) -> bytes | None:
    """This worker's address with its TCP listener's port (network order) replaced by `port`, and another worker
    id (UCX's packed address: a header byte, then the worker's 64-bit id), so that UCX sees a peer, not itself."""
    forged = own
    for mine in _own_tcp_ports():
        forged = forged.replace(struct.pack(">H", mine), struct.pack(">H", port))
    return forged[:1] + os.urandom(8) + forged[9:] if forged != own else None


class Attacker:
    def __init__(self, timeout_s: float, error_handling: bool):
        from ucxx._lib import libucxx as ucx

        from deltamesh.transfer.ucx import rma

        self.ucx, self.rma, self.timeout_s, self.error_handling = ucx, rma, timeout_s, error_handling
        self.context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.RMA))
        self.worker = ucx.UCXWorker(self.context)
        self.address = self.worker.address.tobytes()
        self._own = ctypes.create_string_buffer(4096)  # what a key "for its own memory" registers
        self._own_key = rma.Registration(self.context.handle, ctypes.addressof(self._own), 4096, rma.MEMORY_TYPE_HOST)
        self._kept: list = []  # buffers and requests UCX may still touch

    def _wait(self, done) -> bool:
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            self.worker.progress()
            time.sleep(0.001)
        return True

    def endpoint(self, address: bytes):
        return self.ucx.UCXEndpoint.create_from_worker_address(
            self.worker, self.ucx.UCXAddress.create_from_buffer(address), self.error_handling
        )

    def read(self, ep, address: int, nbytes: int, rkey: bytes | None) -> dict:
        try:
            key = self.rma.RemoteKey(ep.handle, rkey or self._own_key.rkey)
            into = ctypes.create_string_buffer(nbytes)
            request = self.rma.GetRequest(ep.handle, ctypes.addressof(into), nbytes, address, key, 0)
            self._kept += [key, into, request]
            if not self._wait(lambda: request.completed):
                return {"outcome": "timeout"}
            request.check_error()
            return {"outcome": "read", "data": into.raw.hex()}
        except Exception as e:
            return {"outcome": "error", "error": repr(e)}

    def junk(self, ep) -> dict:
        """A notice that does not parse, then one larger than any notice (the holder's receive is 4 KiB)."""
        from ucxx._lib.arr import Array

        sent = []
        for message in (b"\xff" * 64, os.urandom(1 << 16)):
            array = Array(bytearray(message))
            request = ep.tag_send(array, self.ucx.UCXXTag(NOTICE_TAG))
            self._kept += [array, request]
            if not self._wait(lambda r=request: r.completed):
                return {"outcome": "timeout"}
            try:
                request.check_error()
                sent.append(len(message))
            except Exception as e:
                return {"outcome": "error", "error": repr(e)}
        return {"outcome": "sent", "bytes": sent}


def become(uid: int, gid: int) -> None:
    """Drop every privilege of root for good: from here on the kernel checks this process as that user."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    assert (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) == (uid, uid, gid, gid)


def hold(attacker: Attacker, data: bytes) -> None:
    import select

    attacker._own.raw = data.ljust(len(attacker._own.raw), b"\0")
    where = {
        "address": attacker.address.hex(),
        "word_address": ctypes.addressof(attacker._own),
        "rkey": attacker._own_key.rkey.hex(),
    }
    sys.stdout.write(json.dumps(where) + "\n")
    sys.stdout.flush()
    while not select.select([sys.stdin], [], [], 0.001)[0]:  # until the test closes stdin (or kills this)
        attacker.worker.progress()


def main(plan: dict) -> list[dict]:
    os.environ.update(plan.get("ucx_env", {}))
    from ucxx._lib import arr, libucxx  # noqa: F401  (loaded before the privileges go)

    from deltamesh.transfer.ucx import rma  # noqa: F401

    if plan.get("user"):
        become(*plan["user"])
    attacker = Attacker(plan.get("timeout_s", 5.0), plan.get("error_handling", False))
    if "hold" in plan:
        hold(attacker, bytes.fromhex(plan["hold"]))
        return []
    results = []
    for attempt in plan["attempts"]:
        name = attempt["name"]
        if "forge_port" in attempt:
            address = _forge(attacker.address, attempt["forge_port"])
        else:
            address = bytes.fromhex(attempt["address"])
        if address is None:
            results.append({"attempt": name, "read": None, "outcome": "no-forge"})
            continue
        try:
            ep = attacker.endpoint(address)
        except Exception as e:
            results.append({"attempt": name, "read": None, "outcome": "unreachable", "error": repr(e)})
            continue
        for r in attempt.get("reads", []):
            rkey = bytes.fromhex(r["rkey"]) if r.get("rkey") else None
            results.append({"attempt": name, "read": r["name"], **attacker.read(ep, r["address"], r["nbytes"], rkey)})
        if attempt.get("junk"):
            results.append({"attempt": name, "read": "junk", **attacker.junk(ep)})
    return results


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    out = main(json.loads(sys.argv[1]))
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)
