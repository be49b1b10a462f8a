"""Attacks on the UCX side channel (the security review of 2026-12-04, issue #49), against real worker processes.

What the review did, as uid nobody on the mesh's host: found each worker's UCX TCP listener with `ss -ltn`, forged a
UCX worker address from its own (the target's port swapped in), and read the prefill worker's environment (the
mesh secret in it) with an RMA read, or killed a worker with a read at 0x1000 (UCX served those reads in
software over TCP, with no check of the remote key). Before this change the attacks below read 1,343 bytes of the
prefill worker's environment, the mesh secret among them, and the read at 0x1000 killed the decode worker
(SIGSEGV); docs/notes/side-channel-security.md has the record. Now the workers open no network transport on one
host: the attacker (tests/e2e/side_channel_attacker.py, a process with a UCX worker of its own) finds nothing to
forge an address for, and even given a worker's real UCX address and a pool's key it cannot open the worker's
shared memory or read it by CMA, which the kernel allows its owner's user only.

Controls, so that a refusal means the kernel refused and not that the attacker is broken: the same forging
attacker reads a decoy UCX worker set up as the workers were before (TCP on loopback) and kills it at 0x1000, and
an attacker of the mesh's own user reads a pool through the leaked address (and a read at 0x1000 then fails in
the reader's own syscall, never in the worker)."""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from harness import start_mesh
from reliability import record

from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.transfer.leases import lease_nonce
from deltamesh.transfer.ucx import side_channel_env
from deltamesh.v1 import common_pb2, decode_pb2, prefill_pb2, ucx_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.security]

ATTACKER = Path(__file__).with_name("side_channel_attacker.py")
GREEDY = common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
UNMAPPED = 0x1000
# the forging attacker offers TCP only (UCX would otherwise prefer the shared memory of its own forged address)
FORGER_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
ANY_ENV = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}  # every transport UCX has


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # workers started with exec, as users start them: the attacks aim at the environment strings exec put there
    m = start_mesh(str(DEFAULT_MODEL), tmp_path_factory.mktemp("side-channel"), forked_workers=False)
    yield m
    m.stop()  # fails if a process crashed at any point


def another_user() -> tuple[int, int]:
    """nobody's uid and gid, or a skip saying why the attacker cannot be another user here."""
    if os.geteuid() != 0:
        pytest.skip(
            "the attacker must run as another user than the mesh, which takes root here; as the mesh's own user "
            "the kernel rightly lets it read the workers (as it lets ptrace)"
        )
    try:
        nobody = pwd.getpwnam("nobody")
        return nobody.pw_uid, nobody.pw_gid
    except KeyError:
        return 65534, 65534


def attack(plan: dict, timeout_s: float = 180) -> list[dict]:
    """Run the attacker with `plan`; its results (side_channel_attacker.py)."""
    out = subprocess.run(
        [sys.executable, str(ATTACKER), json.dumps(plan)], capture_output=True, text=True, timeout=timeout_s
    )
    lines = out.stdout.strip().splitlines()  # UCX logs to stdout too; the result is the last line
    assert out.returncode == 0 and lines, (
        f"attacker failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
    )
    return json.loads(lines[-1])


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (what `ss -ltnp` shows of it)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if m := re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}")):
                inodes.add(m.group(1))
        except OSError:
            continue
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def environ_of(pid: int) -> dict:
    """Where process `pid`'s environment strings are (proc(5): stat fields 50 and 51), as a read."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # fields[0] is field 3
    return {"name": "environ", "address": start, "nbytes": end - start}


def prefill(worker, rid: str, prompt: list[int], lease_ttl_ms: int = 0) -> prefill_pb2.PrefillResponse:
    request = prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, lease_ttl_ms=lease_ttl_ms
    )
    return worker.stub().Prefill(request, timeout=30)


def decode(worker, rid, prompt, first, lease=None, transport=None) -> list[int]:
    source = decode_pb2.TransferSource(
        lease=lease or first.lease,
        transport=transport or first.transport,
        layout=first.layout,
        first_token_id=first.first.token_ids[0],
    )
    call = worker.stub().Decode(
        decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, source=source), timeout=30
    )
    return [t for d in call for t in d.token_ids]


class Decoy:
    """A UCX worker set up as the mesh's workers were before this change (every transport, TCP on loopback),
    holding `data` in registered memory: what the attacks must still reach, or they prove nothing."""

    def __init__(self, data: bytes):
        plan = {"ucx_env": ANY_ENV, "hold": data.hex()}
        self.popen = subprocess.Popen(
            [sys.executable, str(ATTACKER), json.dumps(plan)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = ""
        while not line.startswith("{"):  # UCX's own warnings come first
            line = self.popen.stdout.readline()
            assert line, "the decoy did not start"
        self.where = json.loads(line)

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.stdin.close()
            self.popen.wait(10)
        return self.popen.returncode


def serves_exactly(mesh, reference_engine, prompt: list[int]) -> bool:
    """A request through the router gets the monolithic engine's greedy tokens."""
    with mesh.client() as client:
        got = client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    want = reference_engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    return list(got.token_ids) == list(want.token_ids)


def test_no_other_user_reaches_a_worker_over_the_side_channel(mesh, reference_engine):
    nobody = another_user()
    holder, puller = mesh.workers("prefill")[0], mesh.workers("decode")[0]
    pids = {w.popen.pid for w in mesh.workers()}
    for w in mesh.workers():  # what `ss -ltnp` shows of the workers: their gRPC ports, and no UCX listener
        assert listening_ports(w.popen.pid) == {int(w.address.rsplit(":", 1)[1])}, w.role
    # held through every attack: 12 s on an idle machine, past the default 30 s lease on a loaded one
    leased = prefill(holder, "held-for-the-attack", list(range(30, 70)), lease_ttl_ms=240_000)
    d = ucx_pb2.UcxLeaseDescriptor.FromString(leased.transport.payload)
    pool = {"name": "pool", "address": d.region_addresses[0], "nbytes": 64, "rkey": d.region_rkeys[0].hex()}
    unmapped = {"name": "unmapped", "address": UNMAPPED, "nbytes": 64}
    decoy = Decoy(b"DECOY-SECRET" * 4)
    try:
        decoy_port, *_ = listening_ports(decoy.popen.pid)
        decoy_word = {"name": "decoy", "address": decoy.where["word_address"], "nbytes": 48}
        started = time.monotonic()
        forged = attack(
            {
                "user": nobody,
                "ucx_env": FORGER_ENV,
                "attempts": [
                    *(
                        {"name": f"{w.role}:{p}", "forge_port": p, "reads": [environ_of(w.popen.pid), pool, unmapped]}
                        for w in mesh.workers()
                        for p in listening_ports(w.popen.pid)
                    ),
                    {"name": "decoy", "forge_port": decoy_port, "reads": [decoy_word, unmapped]},
                ],
            }
        )
        leaked = attack(
            {
                "user": nobody,
                "ucx_env": ANY_ENV,
                "attempts": [
                    {
                        "name": "prefill:leaked",
                        "address": d.worker_address.hex(),
                        "reads": [environ_of(holder.popen.pid), pool, unmapped],
                        "junk": True,
                    }
                ],
            }
        )
        attack_s = time.monotonic() - started
        decoy_exit = decoy.stop()
    finally:
        decoy.stop()
    results = forged + leaked
    print(json.dumps([{k: v for k, v in r.items() if k != "data"} for r in results], indent=1))
    on_mesh = [r for r in results if r["attempt"] != "decoy"]
    # the control: the forging attacker reaches a TCP-exposed UCX worker of another user, reads it, and kills it
    decoy_read = next(r for r in forged if r["attempt"] == "decoy" and r["read"] == "decoy")
    assert decoy_read["outcome"] == "read" and bytes.fromhex(decoy_read["data"]).startswith(b"DECOY-SECRET")
    assert decoy_exit == -signal.SIGSEGV
    # the mesh: no read of any kind, no message delivered, not a byte of the secret
    assert on_mesh and all(r["outcome"] in ("error", "timeout", "unreachable") for r in on_mesh), on_mesh
    assert next(r for r in leaked if r["read"] is None)["outcome"] == "unreachable"
    assert not any(mesh.secret.encode() in bytes.fromhex(r.get("data", "")) for r in results)
    # and it still serves, with the same processes
    assert {w.popen.pid for w in mesh.workers()} == pids and all(p.alive() for p in mesh.procs)
    assert decode(puller, "held-for-the-attack", list(range(30, 70)), leased)
    assert serves_exactly(mesh, reference_engine, list(range(300, 330)))
    assert mesh.wait_idle() == {}
    record(
        "another local user (nobody) forges a UCX address to each worker's TCP ports and reads its environment, a "
        "pool and 0x1000; given a worker's real UCX address and a pool's key, does the same and sends junk "
        "notices",
        "the workers open no network transport on one host (`ss -ltnp`: their gRPC ports only); shared memory "
        "(opened through /proc/<pid>/fd) and CMA are the kernel's to allow, to the workers' own user only: no "
        "endpoint, no byte read, no worker hurt",
        "test_no_other_user_reaches_a_worker_over_the_side_channel",
        f"{len(on_mesh)} attempts, none read a byte (the leaked address: unreachable); the same forging against a "
        f"decoy worker set up as before (TCP on lo) read its memory and killed it with SIGSEGV; attacks "
        f"{attack_s:.1f}s; both workers the same processes, the next request token-exact",
    )


def test_reads_are_one_sided_so_a_bad_one_never_reaches_a_worker(mesh, reference_engine):
    """An attacker of the mesh's own user (whom the kernel lets in, as it lets them ptrace the workers) reads a
    pool through the leaked address; its read at 0x1000 fails in its own CMA syscall and junk notices are dropped:
    the holder takes no part in a read."""
    holder = mesh.workers("prefill")[0]
    pids = {w.popen.pid for w in mesh.workers()}
    leased = prefill(holder, "held-for-the-member", list(range(100, 140)))
    d = ucx_pb2.UcxLeaseDescriptor.FromString(leased.transport.payload)
    pool = {"name": "pool", "address": d.region_addresses[0], "nbytes": 64, "rkey": d.region_rkeys[0].hex()}
    unmapped = {"name": "unmapped", "address": UNMAPPED, "nbytes": 64}
    got = attack(
        {
            "ucx_env": side_channel_env(None),  # what the workers offer
            "error_handling": True,  # as the workers pull (without it, UCX aborts a reader whose read fails)
            "attempts": [  # a failed read ends its endpoint (UCX): each read after it on an endpoint of its own
                {"name": "pool", "address": d.worker_address.hex(), "reads": [pool], "junk": True},
                {"name": "unmapped", "address": d.worker_address.hex(), "reads": [unmapped]},
                {"name": "pool again", "address": d.worker_address.hex(), "reads": [pool]},
            ],
        }
    )
    print(json.dumps([{k: v for k, v in r.items() if k != "data"} for r in got], indent=1))
    assert [r["outcome"] for r in got] == ["read", "sent", "error", "read"], got
    assert "Bad address" in got[2]["error"] or "Input/output" in got[2]["error"], got[2]
    assert {w.popen.pid for w in mesh.workers()} == pids and all(p.alive() for p in mesh.procs)
    assert holder.load().leases == 1  # junk ended nothing
    assert holder.log.read_text().count("bad pull notice") == 2  # both junk messages arrived, and were dropped
    assert decode(mesh.workers("decode")[0], "held-for-the-member", list(range(100, 140)), leased)
    assert serves_exactly(mesh, reference_engine, list(range(330, 360)))
    assert mesh.wait_idle() == {}
    record(
        "a process of the workers' own user reads at 0x1000 through a worker's real UCX address and sends "
        "malformed and oversized notices",
        "reads are one-sided (CMA, CUDA IPC): a bad address fails in the reader's own syscall, the worker runs no "
        "code for it; a notice that does not parse or does not fit is dropped",
        "test_reads_are_one_sided_so_a_bad_one_never_reaches_a_worker",
        "pool read (the control), 0x1000 an error in the reader, junk dropped; the worker the same process, the "
        "next request token-exact",
    )


def test_a_lease_word_is_bound_to_the_memory_it_vouches_for(mesh, reference_engine):
    """The insider of the review (a caller holding the mesh secret) hands a decode worker another request's regions
    in the prefill worker and a lease word in memory of its own holding the matching value, to have that state
    decoded for it: refused before any byte moves, as is a word put anywhere else in the prefill worker."""
    holder, puller = mesh.workers("prefill")[0], mesh.workers("decode")[0]
    victim_prompt = list(range(200, 240))
    victim = prefill(holder, "victim", victim_prompt)  # another user's request, held for its decode worker
    d = ucx_pb2.UcxLeaseDescriptor.FromString(victim.transport.payload)
    mine = common_pb2.Lease(lease_id="insider", token=secrets.token_bytes(16))
    extents = list(zip(d.region_addresses, victim.layout.region_bytes))
    word = Decoy(lease_nonce(mine.token, mine.lease_id, extents).to_bytes(8, "little"))
    try:
        own_word = ucx_pb2.UcxLeaseDescriptor(
            worker_address=bytes.fromhex(word.where["address"]),
            region_addresses=d.region_addresses,
            region_rkeys=d.region_rkeys,
            word_address=word.where["word_address"],
            word_rkey=bytes.fromhex(word.where["rkey"]),
            peer_addresses=[d.worker_address],  # the victim's regions, as the "peer" of the insider's worker
            region_peers=[1] * len(d.region_addresses),
        )
        in_pool = ucx_pb2.UcxLeaseDescriptor.FromString(victim.transport.payload)
        in_pool.word_address, in_pool.word_rkey = d.region_addresses[0], d.region_rkeys[0]
        refused = {}
        for name, forged in (("own memory", own_word), ("the holder's pool", in_pool)):
            transport = common_pb2.TransportDescriptor(kind="ucx", version=2, payload=forged.SerializeToString())
            with pytest.raises(grpc.RpcError) as e:
                decode(puller, f"insider-{len(refused)}", victim_prompt, victim, lease=mine, transport=transport)
            refused[name] = (e.value.code(), e.value.details())
    finally:
        word.stop()
    print(refused)
    assert refused["own memory"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "not announced as a rank" in refused["own memory"][1]
    assert refused["the holder's pool"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "not one of the lease words" in refused["the holder's pool"][1]
    load = puller.load()
    assert load.reservations == load.kv_pages_used == load.state_slots_used == 0
    # the victim's own pull is untouched, token-exact
    want = reference_engine.generate(victim_prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert list(victim.first.token_ids) + decode(puller, "victim", victim_prompt, victim) == want.token_ids
    assert mesh.wait_idle() == {}
    record(
        "a caller with the mesh secret hands a decode worker another request's regions and a lease word in its "
        "own UCX memory holding the matching value (or a word elsewhere in the prefill worker)",
        "refused before any byte moves (INVALID_ARGUMENT): a region must be in the word's worker or a rank the "
        "control plane announced for it, and the word among the lease words its holder announced",
        "test_a_lease_word_is_bound_to_the_memory_it_vouches_for",
        "both refused, nothing reserved; the victim's own pull then token-exact",
    )


def test_across_hosts_whoever_reaches_the_interface_reads_the_workers(tmp_path, reference_engine):
    """The known limit, measured: with --side-channel-interface (here lo) a worker's UCX listens on TCP there, and
    UCX serves reads over TCP in software at any address, so the review's forging attack reads the worker's memory
    again. Hence the deployment rule: that interface must be a network only the mesh's hosts reach."""
    nobody = another_user()
    mesh = start_mesh(
        str(DEFAULT_MODEL), tmp_path, worker_args=["--side-channel-interface", "lo"], forked_workers=False
    )
    try:
        holder = mesh.workers("prefill")[0]
        grpc_port = int(holder.address.rsplit(":", 1)[1])
        ucx_ports = listening_ports(holder.popen.pid) - {grpc_port}
        assert len(ucx_ports) == 1, ucx_ports  # UCX's TCP listener, on 127.0.0.1 (lo) only
        environ = environ_of(holder.popen.pid)
        got = attack(
            {
                "user": nobody,
                "ucx_env": FORGER_ENV,
                "attempts": [{"name": "prefill", "forge_port": ucx_ports.pop(), "reads": [environ]}],
            }
        )
        print([{k: v for k, v in r.items() if k != "data"} for r in got])
        assert got[0]["outcome"] == "read" and mesh.secret.encode() in bytes.fromhex(got[0]["data"])
        assert serves_exactly(mesh, reference_engine, list(range(400, 430)))
        record(
            "with `--side-channel-interface lo`, another local user forges a UCX address to a worker's UCX port "
            "and reads its environment",
            "the known limit across hosts: UCX listens on TCP on that interface and serves reads there in software "
            "at any address, so the interface must be a network only the mesh's hosts reach (threat model)",
            "test_across_hosts_whoever_reaches_the_interface_reads_the_workers",
            f"read {environ['nbytes']:,} bytes of the prefill worker's environment, the mesh secret among them; the "
            "mesh went on serving",
        )
    finally:
        mesh.stop()
