"""Structured outputs with xgrammar: a request's grammar (deltamesh/protocol/structured.py: a JSON schema, any JSON
object, a regex, a choice, EBNF) compiled off the stepping thread and cached, the matcher that follows its tokens,
and the step's stage that masks the logits of its rows.

Compiling (`Grammars`): a spec is parsed when the request is made (`start`: a bad one is the caller's RequestError,
before anything is queued) and compiled against the vocabulary in a small thread pool, as xgrammar's compiler
releases the GIL. The compiler caches what it compiled (by grammar, within a byte budget) and requests that ask
for a grammar being compiled share its job. Until its grammar is compiled a request may run its prompt but not the
token that samples (Request.may_sample, the scheduler): it never holds up the batch; the compile's end wakes the
stepping thread.

Following (`RequestGrammar`): the matcher is made once the grammar is compiled and is fed the request's tokens as
they reach the host (Request.check_stop), those that came before it first: the first token a prefill worker
sampled, under P/D, which the decode worker's matcher replays. A preempted request keeps its matcher, as it keeps
its tokens. A matcher that accepted a stop token has terminated and ends the request (even with ignore_eos); a
token it rejects (only a bug samples one) ends the request with an error.

Masking (`GrammarMasks`, called by the step only when a sampled row has a grammar): the bitmask of each row's allowed
next tokens is filled on the host in threads (xgrammar's BatchGrammarMatcher) once the previous step's tokens are in
the matchers (core.py takes them before this step samples, while the device runs its forward pass), copied to the
device and applied there in place (xgrammar's kernel: Triton on CUDA, its C++ loop on CPU). Sampling, greedy or
not, and the reported logprobs see the masked distribution, as vLLM's do (a masked token's logprob is -inf). A
speculative engine's verify step masks each verified position, the matcher advanced through the drafts before it
and rolled back after (`GrammarMasks.apply`'s `verify`).

xgrammar is imported on the first structured request: it imports transformers, seconds that an engine that never
sees one should not pay at start.
"""

from __future__ import annotations

import functools
import importlib
import json
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from deltamesh.engine.request import RequestError, Status
from deltamesh.engine.sampling import on_device
from deltamesh.protocol.structured import StructuredOutputs

if TYPE_CHECKING:
    from xgrammar import GrammarCompiler, GrammarMatcher

    from deltamesh.engine.request import Request
    from deltamesh.engine.tokenizer import Tokenizer

COMPILE_THREADS = 2
# Whitespace between a JSON output's elements, at most (xgrammar's max_whitespace_cnt): a model that starts emitting
# whitespace in JSON may never stop (greedy decoding especially), so the run is cut short and the JSON goes on.
# Room for JSON pretty-printed 15 levels deep at an indent of 2; vLLM sets no bound.
MAX_JSON_WHITESPACE = 32
CACHE_BYTES = 512 << 20  # compiled grammars kept for reuse (as vLLM's default xgrammar cache)


@functools.cache
def xgrammar():
    return importlib.import_module("xgrammar")


def parse(spec: StructuredOutputs):
    """The spec as an xgrammar Grammar; RequestError saying what is wrong when it does not parse."""
    xgr = xgrammar()
    json_options = {"any_whitespace": not spec.disable_any_whitespace, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(spec.json), **json_options)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **json_options)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if spec.kind == "choice":  # JSON's string escapes are EBNF's
            assert spec.choice is not None, "a choice spec has its choices"
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_quoted(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except RuntimeError as e:  # xgrammar's parsers: "[time] /path/file.cc:line: what is wrong"
        raise RequestError(f"invalid structured output {spec.kind}: {_reason(e)}") from None


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _reason(e: Exception) -> str:
    """xgrammar's message without its source location."""
    text = str(e).strip()
    head, sep, rest = text.partition(": ")
    return rest if sep and ".cc:" in head else text


class RequestGrammar:
    """One request's grammar: its compile job, then its matcher, fed the request's tokens."""

    def __init__(self, compiled: Future):
        self._compiled = compiled
        self.matcher: GrammarMatcher | None = None  # once compiled and first fed
        self._accepted = 0  # output tokens fed to the matcher
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        """Compiled (or failed: `advance` says so): the request may sample."""
        return self._compiled.done()

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self.matcher is not None and self.matcher.is_terminated()

    def advance(self, output_ids: list[int]) -> None:
        """Feed the matcher the output tokens it has not seen (all of them once compiled); sets `error` when the
        grammar failed to compile or rejects a token. Nothing before the compile is done."""
        if self.error is not None or not self._compiled.done():
            return
        if self.matcher is None:
            try:
                self.matcher = xgrammar().GrammarMatcher(self._compiled.result())
            except Exception as e:
                self.error = f"the structured output grammar failed to compile: {_reason(e)}"
                return
        for token in output_ids[self._accepted :]:
            if not self.matcher.accept_token(token):
                self.error = self._rejected(token)
                return
            self._accepted += 1

    def _rejected(self, token: int) -> str:
        """Why the matcher refused a token: the grammar allowed none there (it matches nothing, or nothing
        longer), or the token was sampled against its mask (a bug)."""
        xgr = xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self._compiled.result().tokenizer_info.vocab_size)
        assert self.matcher is not None, "called by advance, with its matcher"
        self.matcher.fill_next_token_bitmask(bitmask)
        if not bitmask.any():
            return (
                f"the structured output grammar allows no token after {self._accepted} tokens: it cannot be completed"
            )
        return f"token {token} does not follow the structured output grammar"


class Grammars:
    """One engine's grammars: the vocabulary as xgrammar reads it, the compiler (cache included), its pool."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: Iterable[int]):
        """`vocab_size`: the model's (its logits' width), which may exceed the tokenizer's."""
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.on_compiled: Callable[[], None] | None = None  # wakes the stepping thread (Engine)
        self._lock = threading.Lock()  # the jobs
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()  # its making, which takes seconds (held by a pool thread only)
        self._compiling: dict[str, Future] = {}  # spec key -> its job, while it runs

    def start(self, spec: StructuredOutputs) -> RequestGrammar:
        """A request's grammar, its compile started (any thread); RequestError when the spec does not parse."""
        if self.tokenizer is None:
            raise RequestError("structured outputs need the model's tokenizer, and this model has none")
        grammar = parse(spec)
        with self._lock:
            job = self._compiling.get(spec.key)
            started = job is None
            if job is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
                job = self._compiling[spec.key] = self._pool.submit(self._compile, grammar)
        if started:  # not under the lock: a job done already calls back at once, here, and `_done` takes the lock
            key = spec.key
            job.add_done_callback(lambda _: self._done(key))
        return RequestGrammar(job)

    def _done(self, key: str) -> None:
        with self._lock:
            self._compiling.pop(key, None)
        if self.on_compiled is not None:
            self.on_compiled()

    def _compile(self, grammar):
        with self._compiler_lock:
            if self._compiler is None:
                assert self.tokenizer is not None, "start refuses grammars without a tokenizer"
                xgr = xgrammar()
                self._compiler = xgr.GrammarCompiler(
                    tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.stop_token_ids),
                    max_threads=COMPILE_THREADS,
                    cache_limit_bytes=CACHE_BYTES,
                )
            compiler = self._compiler
        return compiler.compile_grammar(grammar)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def tokenizer_info(xgr, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the engine's own tokenizer (tokenizers' vocabulary, never a hub): its encoding detected
    as xgrammar detects a Hugging Face tokenizer's, the model's vocabulary size (logits past the tokenizer's
    vocabulary are never allowed), the engine's stop tokens. Special tokens are blanked, which xgrammar reads as
    special: never allowed but as stop tokens. A grammar must not match `<|im_start|>` as text that the
    detokenizer then drops."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast  # xgrammar's own dependency

    backend = tokenizer.backend
    wrapped = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(backend.to_str()))  # a copy to set up
    detected = xgr.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
    vocab = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            vocab[index] = token
    for index, added in backend.get_added_tokens_decoder().items():
        if added.special and index < vocab_size:
            vocab[index] = ""
    return xgr.TokenizerInfo(
        vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids or None,
        add_prefix_space=detected.add_prefix_space,
    )


class GrammarMasks:
    """The step's stage that masks the logits of the rows sampled under a grammar (module docstring)."""

    def __init__(self):
        self._batch = None  # xgrammar's BatchGrammarMatcher (its fill threads), made with the first mask

    def apply(self, logits: torch.Tensor, requests: list[Request], verify: tuple[int, int] | None = None) -> float:
        """Mask `logits` (row i: requests[i]) in place where a running request has a grammar, its matcher up to
        date; returns the host's seconds on it (filling the bitmask, queueing its copy and the kernel).

        `verify` (num_verify n, width w): a verify step's layout, each of the first n requests with w rows (its
        positions after its drafts 1..j: `Request.draft_ids`, on the host once the step before is read). Position
        j's mask is that of the matcher advanced through drafts 1..j, which is rolled back after; past a draft the
        grammar refuses (or past its end) a position is left unmasked: the acceptance never reaches it, as the
        position before masks that draft out."""
        grammars = [i for i, r in enumerate(requests) if r.grammar is not None and r.status != Status.FINISHED]
        if not grammars:
            return 0.0
        started = time.perf_counter()
        xgr = xgrammar()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        cuda = logits.is_cuda
        words = (logits.shape[-1] + 31) // 32
        bitmask = torch.empty((logits.shape[0], words), dtype=torch.int32, pin_memory=cuda)
        n, w = verify if verify is not None else (0, 1)
        matchers = [grammar.matcher for i in grammars if (grammar := requests[i].grammar) is not None]  # all of them
        first_rows = [i * w if i < n else n * w + i - n for i in grammars]
        rows = self._fill_positions(bitmask, matchers, first_rows, [requests[i] for i in grammars], n, w)
        indices: list[int] | torch.Tensor | None = None if len(rows) == logits.shape[0] else rows
        if cuda:  # queued behind the forward pass, without waiting for it
            bitmask = bitmask.to(logits.device, non_blocking=True)
            indices = None if indices is None else on_device(rows, torch.int32, logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)
        return time.perf_counter() - started

    def _fill_positions(self, bitmask, matchers, first_rows: list[int], requests: list[Request], n: int, w: int):
        """Each matcher's masks into its rows (one, or a verifying request's w); the rows filled, in order."""
        assert self._batch is not None, "made by apply"
        k = w - 1
        verifying = [row < n * w for row in first_rows]
        drafts = [(r.draft_ids + [0] * k)[:k] if v else [] for r, v in zip(requests, verifying)]
        live = list(range(len(matchers)))  # matchers still following their drafts
        advanced = [0] * len(matchers)
        filled: list[int] = []
        for j in range(w):
            self._batch.batch_fill_next_token_bitmask(
                [matchers[m] for m in live], bitmask, [first_rows[m] + j for m in live]
            )
            filled += [first_rows[m] + j for m in live]
            if j == k:
                break
            following = []
            for m in live:
                if verifying[m] and matchers[m].accept_token(drafts[m][j]):
                    advanced[m] += 1
                    if not matchers[m].is_terminated():
                        following.append(m)
            live = following
        for matcher, steps in zip(matchers, advanced):
            if steps:
                matcher.rollback(steps)
        return sorted(filled)
