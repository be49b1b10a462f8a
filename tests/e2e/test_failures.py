"""Workers dying under the mesh: the client hears fast, the router routes around the dead."""

import signal
import threading
import time

import pytest

from deltamesh.client import DeltameshError
from engine import DEFAULT_MODEL
from harness import start_mesh

pytestmark = pytest.mark.e2e


def test_killed_decode_worker_fails_the_stream_fast_and_the_router_keeps_serving(tmp_path):
    mesh = start_mesh(str(DEFAULT_MODEL), tmp_path, prefill=1, decode=2)
    try:
        with mesh.client() as client:
            stream = client.stream("The Python language", max_tokens=3000, temperature=0, ignore_eos=True)
            it = iter(stream)
            for _ in range(5):
                next(it)
            victim = next(p for p in mesh.workers("decode") if p.load().running)
            errors = []

            def drain():
                try:
                    for _ in it:
                        pass
                except DeltameshError as e:
                    errors.append((time.monotonic(), e))

            reader = threading.Thread(target=drain)
            reader.start()
            killed_at = time.monotonic()
            mesh.kill(victim, signal.SIGKILL)
            reader.join(10)
            assert errors, "the stream did not fail"
            assert errors[0][0] - killed_at < 2.0
            for _ in range(3):  # the surviving decode worker serves new requests
                assert client.generate("A list is", max_tokens=5).usage.completion_tokens == 5
        assert mesh.wait_idle() == {}
    finally:
        mesh.stop()


def test_killed_prefill_worker_is_routed_around(tmp_path):
    mesh = start_mesh(str(DEFAULT_MODEL), tmp_path, prefill=2, decode=1)
    try:
        mesh.kill(mesh.workers("prefill")[0], signal.SIGKILL)
        with mesh.client() as client:
            for _ in range(4):
                assert client.generate("In this tutorial, we", max_tokens=4).usage.completion_tokens == 4
        assert mesh.wait_idle() == {}
    finally:
        mesh.stop()
