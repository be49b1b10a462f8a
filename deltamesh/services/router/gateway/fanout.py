"""How many of one request's choices enter the mesh at once.

The workers serve requests in arrival order. A request whose 1,024 prompts all entered the mesh together would put
every one of them ahead of the next client's request: that client's first token waited for the whole batch's
prefill (17.4 s in a security review, minutes on a slow CPU). So a request's choices start in order, one after
another, each once both bounds below allow it:

- prefill: its choices waiting for their first token hold at most `prefill_tokens` prompt tokens together (a
  longer prompt goes alone). That is all one request can put ahead of another client's first token: about one
  engine step's prefill, whatever the request's size. A choice's first token frees its share.
- running: at most `running` of its choices are in the mesh at once (prefill or decode), so that one request
  cannot fill the decode workers' admission queues either.

Fairness is per request: the router cannot tell clients apart behind one API key or one proxy address, and a client
that sends many requests at once is as much load as as many clients (the workers' own admission bounds that)."""

from __future__ import annotations

import asyncio


class Fanout:
    def __init__(self, running: int, prefill_tokens: int):
        self.max_running, self.max_prefill_tokens = running, prefill_tokens
        self.running = self.prefilling = self.prefill_tokens = 0
        self._changed = asyncio.Event()

    def _fits(self, tokens: int) -> bool:
        if self.running >= self.max_running:
            return False
        return self.prefilling == 0 or self.prefill_tokens + tokens <= self.max_prefill_tokens

    async def start(self, tokens: int) -> None:
        """Wait until a choice of `tokens` prompt tokens may start, and count it in. One caller at a time (the
        request's choices start in order)."""
        while not self._fits(tokens):
            self._changed.clear()
            await self._changed.wait()
        self.running += 1
        self.prefilling += 1
        self.prefill_tokens += tokens

    def prefilled(self, tokens: int) -> None:
        """The choice's first token arrived: its prompt no longer waits ahead of anyone."""
        self.prefilling -= 1
        self.prefill_tokens -= tokens
        self._changed.set()

    def ended(self) -> None:
        self.running -= 1
        self._changed.set()
