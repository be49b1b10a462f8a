"""The router's side of the side channel's announcements (no network: a handle's channel is only used to call a
worker): each puller hears of the holders of the role it pulls from, and no two workers may claim one transport
endpoint, whichever role claims it."""

from deltamesh.services.router.registry import WorkerHandle, WorkerRegistry
from deltamesh.v1 import common_pb2


def described(*endpoints: bytes) -> common_pb2.TransportDescriptor:
    return common_pb2.TransportDescriptor(kind="ucx", version=2, payload=b"opaque", endpoints=endpoints)


def registry_of(*roles: str) -> tuple[WorkerRegistry, list[WorkerHandle]]:
    registry = WorkerRegistry(health_interval_s=0.5, heartbeat_interval_s=1.0, mesh_secret="s")
    handles = [WorkerHandle(f"w{i}:1", role, static=True, channel=None) for i, role in enumerate(roles)]
    registry.workers = {w.address: w for w in handles}
    return registry, handles


def test_each_puller_hears_of_the_holders_it_pulls_from():
    registry, (prefill, decode, colocated, bare) = registry_of("prefill", "decode", "colocated", "prefill")
    assert registry.record_holder(prefill, described(b"P"))
    assert registry.record_holder(decode, described(b"D"))
    assert registry.record_holder(colocated, None) and registry.record_holder(bare, None)
    assert [d.endpoints for d in registry.announcements("decode")] == [[b"P"]]
    assert [d.endpoints for d in registry.announcements("prefill")] == [[b"D"]]  # for the reverse pull
    assert registry.announcements("colocated") == []


def test_no_worker_claims_another_workers_endpoint():
    """The insider of the side-channel note: a "prefill worker" whose description names a decode worker's UCX
    worker as its rank (or as its own) is refused and announced to no one; the first claim stands."""
    registry, (decode, fake, honest) = registry_of("decode", "prefill", "prefill")
    assert registry.record_holder(decode, described(b"D"))
    assert not registry.record_holder(fake, described(b"F", b"D"))
    assert not registry.record_holder(fake, described(b"D"))
    assert not registry.record_holder(fake, described())  # an endpoint-less description cannot be checked
    assert fake.holder is None and registry.announcements("decode") == []
    assert registry.record_holder(honest, described(b"P", b"P-rank1"))
    assert registry.record_holder(decode, described(b"D"))  # a worker's own claim again: still its own
    assert [d.endpoints for d in registry.announcements("decode")] == [[b"P", b"P-rank1"]]
