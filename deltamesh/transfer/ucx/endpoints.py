"""A puller's UCX endpoints: one per peer worker address, reused across pulls, with the remote keys unpacked
for it."""

from __future__ import annotations

from deltamesh.transfer.ucx import loop_worker, rma


class Endpoints:
    def __init__(self, error_handling: bool):
        self.error_handling = error_handling
        self._eps: dict[bytes, object] = {}
        self._rkeys: dict[bytes, dict[bytes, object]] = {}  # peer address -> packed key -> unpacked
        self._retired: list[tuple[object, dict]] = []  # (endpoint left open or None, its keys) until close()

    def get(self, address: bytes):
        ep = self._eps.get(address)
        if ep is None:
            ep = self._eps[address] = loop_worker.get().endpoint(address, self.error_handling)
        return ep

    def rkey(self, address: bytes, packed: bytes):
        """The peer's remote key, unpacked once per endpoint (a holder registers its pools once, so every lease
        from it carries the same few keys)."""
        keys = self._rkeys.setdefault(address, {})
        key = keys.get(packed)
        if key is None:
            key = keys[packed] = rma.RemoteKey(self.get(address).handle, packed)
        return key

    def drop(self, address: bytes) -> None:
        """Close the endpoint to a peer (after a failure on it; UCX then ends what is still on it): the next
        transfer makes a new one."""
        self._retire(address, close=True)

    def forget(self, address: bytes) -> None:
        """Make a new endpoint next time, leaving this one to what is still on it (reads, a notice)."""
        self._retire(address, close=False)

    def _retire(self, address: bytes, close: bool) -> None:
        # A remote key may still be used by a read in flight: keys are destroyed only in close().
        ep = self._eps.pop(address, None)
        if close:
            close_endpoint(ep)
        self._retired.append((None if close else ep, self._rkeys.pop(address, {})))

    def close(self) -> None:
        for address in list(self._eps):
            self._retire(address, close=False)
        for ep, keys in self._retired:
            for key in keys.values():
                key.close()
            close_endpoint(ep)
        self._retired.clear()


def close_endpoint(ep) -> None:
    if ep is not None and ep.alive:
        try:
            ep.close()
        except Exception:  # already gone with its peer
            pass
