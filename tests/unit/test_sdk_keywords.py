"""The SDK's generate and stream take build_request's sampling keywords through `**kwargs`: their docstring
names every one, and an unknown keyword is refused naming it and those taken (no request is sent)."""

import asyncio

import pytest

from deltamesh.client import AsyncClient, Client
from deltamesh.client.client import _KEYWORDS


def test_generate_names_its_keywords_and_refuses_unknown_ones():
    assert all(name in Client.generate.__doc__ for name in _KEYWORDS)
    with Client("127.0.0.1:1", retries=0, timeout=1) as client:
        for call in (client.generate, client.stream):
            with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) n;.*max_tokens, temperature"):
                call("hi", n=2, max_tokens=3)

    async def refused():
        async with AsyncClient("127.0.0.1:1", retries=0, timeout=1) as client:
            with pytest.raises(TypeError, match="unknown keyword argument"):
                await client.generate("hi", best_of=2)
            with pytest.raises(TypeError, match="unknown keyword argument"):
                client.stream("hi", best_of=2)

    asyncio.run(refused())
