"""The UCX transport (ucxx + UCX RMA): one-sided pulls of leased state (deltamesh/transfer/ucx/puller.py), its
descriptors (deltamesh/transfer/ucx/descriptors.py, protos/deltamesh/v1/ucx.proto).

Who can reach the side channel is decided here, by the UCX transports a worker opens (the measurements behind each
choice: docs/notes/side-channel-security.md). UCX answers a peer's *software* RMA request (the emulation it falls
back to on transports without RMA in hardware, TCP and shared-memory queues among them) by copying from or to
whatever address the peer names, with no check of a remote key: any peer that reaches a worker's UCX can read or
write its whole memory, or crash it with an unmapped address. So the only defence is who can be a peer at all:

- one host (the default): shared memory (`posix`, its file shared through /proc/<pid>/fd, which the kernel opens
  only for the owner's user or root), CMA (process_vm_readv: ptrace rights, the same user or root), CUDA IPC on
  GPUs, and no network transport, so no listening socket. Another user of the host cannot open the worker's shared
  memory or read it by CMA; the workers of a mesh must run as one user. (System V shared memory is left out: UCX
  makes its segments group-writable.)
- across hosts (`--side-channel-interface IFACE`): the same, plus TCP on that interface only. TCP carries RMA in
  software, so anyone who can open a connection to the worker's UCX port can read or write its memory: the
  interface must be a network only the mesh's hosts reach (docs/RELIABILITY.md, threat model).
"""

from __future__ import annotations

import os

import structlog

from deltamesh.transfer.base import Transport
from deltamesh.transfer.leases import LeaseTable
from deltamesh.transfer.ucx import descriptors, loop_worker
from deltamesh.transfer.ucx.holder import UcxHolder
from deltamesh.transfer.ucx.puller import UcxPuller

log = structlog.get_logger("deltamesh.transfer")

# Within a host: the process itself, shared memory (through /proc/<pid>/fd), CMA; with GPUs, CUDA IPC and copies.
LOCAL_TRANSPORTS, CUDA_TRANSPORTS = "self,posix,cma", "cuda_copy,cuda_ipc"


def side_channel_env(interface: str | None, cuda: bool = False) -> dict[str, str]:
    """The UCX settings of a worker's side channel: on one host only (`interface` None), or also over TCP on
    `interface`; `cuda`: its pools are in GPU memory."""
    transports = [LOCAL_TRANSPORTS] + [CUDA_TRANSPORTS] * cuda + ["tcp"] * bool(interface)
    return {
        "UCX_TLS": ",".join(transports),
        # the shared-memory file opened through /proc/<pid>/fd (the kernel's ptrace check), never by a name in
        # /dev/shm
        "UCX_POSIX_USE_PROC_LINK": "y",
        # With peer error handling (a dead holder is reported), UCX takes shared memory only where the transport
        # says it can detect a dead peer (posix checks the peer's pid), and CMA's zero-copy reads only where the
        # memory domain claims it can revoke a peer's access after an error. CMA has no registration to revoke
        # (UCX's own note: a stub); what that would protect, bytes read from memory already reused, the lease word
        # checks on every pull (deltamesh/transfer/leases.py).
        "UCX_POSIX_ERROR_HANDLING": "y",
        "UCX_CMA_MEMORY_INVALIDATE": "y",
        **({"UCX_NET_DEVICES": interface} if interface else {}),
    }


def fast_pull_env(environ) -> dict[str, str]:
    """Speed settings for pulls of GPU pools, each left as the user set it. UCX turns CUDA IPC reads (`get_zcopy`)
    off on a GPU without active NVLink links, a one-GPU host among them, where two workers on one GPU then copy
    through host memory in slices (bench/RESULTS.md, "P/D on one GPU"); `y` keeps the reads on the GPU (same-GPU
    copies, or PCIe peer reads)."""
    return {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")}


class UcxTransport(Transport):
    kind, version = descriptors.KIND, descriptors.VERSION
    rank_exporter = "deltamesh.transfer.ucx.rank_memory:export"

    def __init__(
        self, interface: str | None = None, error_handling: bool = True, spin_s: float = 0.02, cuda: bool = False
    ):
        """Made before UCX starts in this process (its settings are read then; a parallel worker's other ranks
        inherit them): the side channel on one host only, or also over TCP on network `interface`, for pools in
        host memory or (`cuda`) on GPUs (side_channel_env). `error_handling`, `spin_s`: see UcxPuller."""
        env = side_channel_env(interface, cuda)
        replaced = {k: os.environ[k] for k in env if os.environ.get(k, env[k]) != env[k]}
        if replaced:  # a UCX_TLS set by hand could open TCP to every local user again
            log.warning("UCX settings replaced by the side channel's own", replaced=replaced, now=env)
        os.environ.update(env)
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        if cuda:
            os.environ.update(fast_pull_env(os.environ))
        self.interface, self.error_handling, self.spin_s = interface, error_handling, spin_s

    @classmethod
    def from_settings(cls, settings) -> UcxTransport:
        cuda = settings.engine.torch_device().type == "cuda"
        return cls(settings.side_channel_interface, settings.ucx_error_handling, cuda=cuda)

    def holder(self, leases: LeaseTable) -> UcxHolder:
        return UcxHolder(leases)

    def puller(self, settle_grace_s: float = 10.0) -> UcxPuller:
        return UcxPuller(self.error_handling, settle_grace_s, self.spin_s, self.interface)

    def close(self) -> None:
        """Release this process's UCX worker, so that another event loop (tests) can create a new one."""
        loop_worker.close()
