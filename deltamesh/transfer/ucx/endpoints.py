"""A puller's UCX endpoints: one per peer worker address, reused across pulls, with the remote keys unpacked
for it."""

from __future__ import annotations

from deltamesh.transfer.ucx import loop_worker, rma


class Unreachable(ConnectionError):
    """UCX found no transport of this worker's side channel that reaches the peer."""


class Endpoints:
    def __init__(self, error_handling: bool, interface: str | None = None):
        self.error_handling, self.interface = error_handling, interface
        self._eps: dict[bytes, object] = {}
        self._rkeys: dict[bytes, dict[bytes, object]] = {}  # peer address -> packed key -> unpacked
        self._retired: list[tuple[object, dict]] = []  # (endpoint left open or None, its keys) until close()

    def get(self, address: bytes):
        ep = self._eps.get(address)
        if ep is None:
            from ucxx.exceptions import UCXUnreachableError

            try:
                ep = self._eps[address] = loop_worker.get().endpoint(address, self.error_handling)
            except UCXUnreachableError:
                reach = (
                    f"this host and network interface {self.interface}"
                    if self.interface
                    else "this host only, for processes of the same user (workers on other hosts need "
                    "--side-channel-interface)"
                )
                raise Unreachable(f"the peer's UCX worker is out of this side channel's reach: {reach}") from None
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
