"""Router-side admission (deltamesh/services/router/admission.py) against real processes: more streams than the
decode worker has slots wait at the router, before their prefill, and all complete whatever the decode worker's
--admission-timeout; a full queue answers 429 / RESOURCE_EXHAUSTED at once; the queue's metrics."""

import asyncio
import threading
import time

import grpc
import httpx
import pytest
from harness import start_mesh
from prometheus_client.parser import text_string_to_metric_families

from deltamesh.client import AsyncClient, DeltameshError
from deltamesh.engine import DEFAULT_MODEL

pytestmark = pytest.mark.e2e
MODEL = str(DEFAULT_MODEL)


def router_metrics(http_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("deltamesh_router_"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


class Sampler:
    """The router's admission queue length, sampled while a load runs: its largest value."""

    def __init__(self, http_port: int):
        self.http_port, self.most = http_port, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            waiting = router_metrics(self.http_port).get("deltamesh_router_requests_waiting", 0.0)
            self.most = max(self.most, waiting)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


STREAMS, SLOTS, TOKENS = 48, 4, 96


def test_more_streams_than_decode_slots_all_complete_queued_at_the_router(tmp_path):
    """The issue's load (1P+1D, 4 decode slots, 48 streams of 96 tokens) with a decode --admission-timeout far
    shorter than a stream: before router-side admission, streams died mid-stream with "decode worker is full: no pool
    space" after their first token; now each waits at the router until a decode slot is its own."""
    mesh = start_mesh(
        MODEL,
        tmp_path,
        http=True,
        role_args={"decode": ["--max-num-seqs", str(SLOTS), "--admission-timeout", "0.2"]},
    )
    try:
        outcomes: dict[str, int] = {}

        async def run():
            async with AsyncClient(mesh.router_address, retries=0) as client:

                async def one(i: int):
                    prompt = [10 + (i * 37 + k) % 3000 for k in range(8 + i % 24)]
                    try:
                        result = await client.generate(
                            prompt, max_tokens=TOKENS, temperature=0, ignore_eos=True, timeout=300
                        )
                        outcome = "completed" if len(result.token_ids) == TOKENS else f"{len(result.token_ids)} tokens"
                    except DeltameshError as e:
                        outcome = f"{e.code.name}: {e.message[:80]}"
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1

                await asyncio.gather(*(one(i) for i in range(STREAMS)))

        with Sampler(mesh.http_port) as queue:
            asyncio.run(run())
        assert outcomes == {"completed": STREAMS}, outcomes
        assert queue.most > 0  # they did wait at the router
        m = router_metrics(mesh.http_port)
        assert m["deltamesh_router_request_queue_time_seconds_count"] == STREAMS
        assert m["deltamesh_router_request_queue_time_seconds_sum"] > 0
        assert m["deltamesh_router_requests_waiting"] == 0 and m["deltamesh_router_requests_admitted"] == 0
        assert m.get("deltamesh_router_admission_rejected_total{reason=queue_full}", 0) == 0
        assert mesh.wait_idle(timeout=30) == {}
    finally:
        mesh.stop()


def test_a_full_queue_answers_429_and_resource_exhausted_before_any_work(tmp_path):
    mesh = start_mesh(
        MODEL,
        tmp_path,
        http=True,
        router_args=["--max-queued-requests", "2"],
        role_args={"decode": ["--max-num-seqs", "1"]},
    )
    url = f"http://127.0.0.1:{mesh.http_port}"
    try:

        async def run():
            async with AsyncClient(mesh.router_address, retries=0) as client:
                # the one decode slot, held by a long stream; two more wait in the queue (its whole length)
                holder = client.stream([11, 12, 13], max_tokens=3000, temperature=0, ignore_eos=True, timeout=300)
                first = await holder.__aiter__().__anext__()
                assert first.token_ids
                queued = [
                    asyncio.create_task(
                        client.generate([20 + i, 21, 22], max_tokens=8, temperature=0, ignore_eos=True, timeout=300)
                    )
                    for i in range(2)
                ]
                deadline = time.monotonic() + 60
                while router_metrics(mesh.http_port).get("deltamesh_router_requests_waiting") != 2:
                    assert time.monotonic() < deadline, router_metrics(mesh.http_port)
                    await asyncio.sleep(0.1)
                # queued at the router: the prefill worker holds nothing of theirs
                (prefill,) = mesh.workers("prefill")
                load = prefill.load()
                assert (load.running, load.waiting, load.held_states) == (0, 0, 0), load
                async with httpx.AsyncClient(timeout=30) as http:
                    started = time.monotonic()
                    r = await http.post(
                        f"{url}/v1/completions", json={"model": "deltamesh-tiny", "prompt": "a list", "max_tokens": 4}
                    )
                    rest_seconds = time.monotonic() - started
                assert r.status_code == 429, r.text
                assert r.headers.get("retry-after") == "1"
                assert r.json()["error"]["type"] == "rate_limit_exceeded" and "queue" in r.json()["error"]["message"]
                with pytest.raises(DeltameshError) as refused:
                    await client.generate([30, 31, 32], max_tokens=4, timeout=30)
                assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                # refused without waiting for a slot: the holder has thousands of tokens to go (a generous bound:
                # the 2-core test machine is shared)
                assert rest_seconds < 10
                await holder.cancel()
                results = await asyncio.gather(*queued)
                assert [len(x.token_ids) for x in results] == [8, 8]

        asyncio.run(run())
        m = router_metrics(mesh.http_port)
        assert m["deltamesh_router_admission_rejected_total{reason=queue_full}"] == 2
        assert m["deltamesh_router_request_queue_time_seconds_count"] == 3  # the holder and the two that waited
        assert mesh.wait_idle(timeout=30) == {}
    finally:
        mesh.stop()
