"""The token feed (decode.proto `Feed`, #45) between the real router and real workers: concurrent streams through it
give the monolithic engine's greedy tokens, each delivered once, in order, with running usage and its final delta
last; every decode leg went over the feed (the router's deltamesh_router_decode_calls, by path). Faults on the feed
path (a decode worker killed mid-stream) are tests/e2e/test_faults.py's, which checks it went over the feed too."""

import asyncio

import pytest
from harness import start_mesh
from test_admission import router_metrics

from deltamesh.client import AsyncClient
from deltamesh.engine import DEFAULT_MODEL, SamplingParams

pytestmark = pytest.mark.e2e
MODEL = str(DEFAULT_MODEL)
STREAMS = 12


async def stream_all(address: str, prompts: list[str], max_tokens: int) -> list[list]:
    async with AsyncClient(address) as client:

        async def one(prompt: str) -> list:
            async with client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True) as stream:
                return [d async for d in stream]

        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize("roles", [(1, 1, 0), (0, 0, 1)], ids=["prefill+decode", "colocated"])
def test_concurrent_streams_over_the_feed_match_the_monolithic_engine(tmp_path, reference_engine, roles):
    prefill, decode, colocated = roles
    mesh = start_mesh(MODEL, tmp_path, prefill=prefill, decode=decode, colocated=colocated, http=True)
    try:
        prompts = [f"Item {i}: the Python language" for i in range(STREAMS)]
        streams = asyncio.run(stream_all(mesh.router_address, prompts, max_tokens=20))
        refs = reference_engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        for deltas, ref in zip(streams, refs):
            assert [t for d in deltas for t in d.token_ids] == ref.token_ids
            assert "".join(d.text for d in deltas) == ref.text
            delivered = [len(d.token_ids) for d in deltas]
            assert all(delivered)
            assert [d.usage.completion_tokens for d in deltas] == [sum(delivered[: i + 1]) for i in range(len(deltas))]
            assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
            assert deltas[-1].finish_reason == "length"
        m = router_metrics(mesh.http_port)
        assert m.get("deltamesh_router_decode_calls_total{via=feed}") == STREAMS, m
        assert m.get("deltamesh_router_decode_calls_total{via=stream}", 0) == 0
        assert mesh.wait_idle() == {}
    finally:
        mesh.stop()
