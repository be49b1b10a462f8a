"""A request's life inside the engine: how one is made from a prompt (`RequestBuilder`), its state from step to
step, and what the engine reports about it after each step."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltamesh.engine.tokenizer import IncrementalDetokenizer
from deltamesh.protocol.requests import RequestError, validate_request
from deltamesh.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from deltamesh.engine.cache import KVPagePool
    from deltamesh.engine.grammar import RequestGrammar
    from deltamesh.engine.reservations import RankParts
    from deltamesh.engine.tokenizer import Tokenizer
    from deltamesh.engine.tp_handoff import Staged


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    rank: int | None = None  # prompt logprobs: the token's rank in the vocabulary (1: the likeliest)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the system
    ERROR = "error"  # the engine failed while running it


@dataclass
class RequestOutput:
    """One step's news about one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    num_cached_tokens: int = 0  # of its prompt, the tokens its first admission took from the prefix cache
    # SamplingParams.prompt_logprobs: with its first token, one per prompt token after the first
    prompt_logprobs: list[TokenLogprobs] | None = None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the same request's next one as one (what a consumer that fell behind takes at once)."""
        return RequestOutput(
            self.request_id,
            self.new_token_ids + later.new_token_ids,
            self.new_text + later.new_text,
            self.logprobs + later.logprobs,
            later.finished,
            later.finish_reason,
            later.stop_reason,
            later.num_prompt_tokens,
            later.num_output_tokens,
            later.error,
            later.num_cached_tokens,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    eos_token_ids: frozenset[int] = frozenset()
    # Prefill-only (disaggregated prefill worker): finish after the first token but keep the state.
    hold_state: bool = False
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV / GDN state are in the pools (or being written by a launched step)
    # Tokens sampled on the device but not yet read by the host (async scheduling: at most the last two steps').
    # They count as tokens, so a decode step can be scheduled before its input reaches the host; the runner
    # takes that input from the previous step's device tensor, row `pending_row`.
    num_pending: int = 0
    pending_row: int = 0
    # speculative decoding: the tokens drafted after its last token, as the host last read them (a step launched
    # before that read takes its drafts on the device: spec/runner.py)
    draft_ids: list[int] = field(default_factory=list)
    verifying: bool = False  # its last launched step verified drafts (it may commit more than one token)
    slot: int | None = None
    # KV pages in token order. Only ever appended to in place or replaced by a new list: the model
    # runner caches each request's pages as an array on that basis.
    pages: list[int] = field(default_factory=list)
    dp_rank: int = 0  # data-parallel attention: the rank whose pools hold `slot` and `pages`
    staged: Staged | None = None  # a parallel engine: its place in the hand-off area
    parts: RankParts | None = None  # arrived as its sender's rank parts, until merged
    # Prefix cache (prefix_cache.py): the hash-chain keys of the prompt's full pages, computed once, and how many
    # of its prompt pages the cache has been offered since the request was (re)admitted.
    block_keys: list[int] = field(default_factory=list)
    num_registered_pages: int = 0
    turn_end: int = 0  # where the prompt's first chat message ends (a checkpoint position there), 0: nowhere
    # a chat prompt that finishes here checkpoints its last page boundary all the same: copies of it wait to start
    # there (shared_prefill.keep_prompt_checkpoint)
    keeps_prompt_checkpoint: bool = False
    # prompt tokens its first admission did not compute: a prefix-cache hit, or a prefix pulled from another
    # worker's cache (usage's cached_tokens, as vLLM counts them: a preempted request's re-admission adds none)
    num_cached_tokens: int | None = None
    grammar: RequestGrammar | None = None  # structured outputs: what its tokens must follow (grammar.py)
    status: Status = Status.WAITING
    adjusts_logits: bool = field(init=False)  # its params' (penalties.py reads it every step: a plain attribute)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # time.monotonic() when the engine took it in (its commands), first scheduled it, and read its first token
    arrival_time: float | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    # SamplingParams.prompt_logprobs: those read so far (entry i: prompt token i + 1's), and how many positions
    # launched steps compute (a recomputed prompt, after a preemption, asks for the rest only)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_asked: int = 0

    def __post_init__(self) -> None:
        self.adjusts_logits = self.params.adjusts_logits

    def ids_between(self, start: int, stop: int) -> list[int]:
        """(prompt_ids + output_ids)[start:stop] without concatenating them (a decode step needs one id of a
        long prompt). Pending tokens are not known here: the list stops short of them."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:
            return self.output_ids[start - n : stop - n]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    @property
    def held_slot(self) -> int:
        """`slot`, where the request is known to hold one (admitted, held for a puller, or arriving)."""
        assert self.slot is not None, f"request {self.request_id} holds no state slot"
        return self.slot

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def last_token_pending(self) -> bool:
        """Its pending token surely ends it (prefill-only, or max_tokens reached): nothing to run ahead of it."""
        return self.num_pending > 0 and (
            self.hold_state or len(self.output_ids) + self.num_pending >= self.params.max_tokens
        )

    @property
    def may_sample(self) -> bool:
        """False while its grammar compiles: it may run its prompt, not the token that samples (scheduler)."""
        return self.grammar is None or self.grammar.ready

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    def add_token(self, token: int, logprob: TokenLogprobs | None, max_model_len: int) -> RequestOutput:
        """Append a sampled token and decide whether it ends the request: this step's output (a stop token ends
        the text without adding its own, unless include_stop_str_in_output; the last output flushes the
        detokenizer)."""
        self.output_ids.append(token)
        detok = self.detokenizer
        keep_text = not self._stops_on(token) or self.params.include_stop_str_in_output
        text = detok.add(token) if detok is not None and keep_text else ""
        self.check_stop(token, max_model_len)
        if self.finish_reason is not None and detok is not None:
            text += detok.flush()
        return RequestOutput(
            self.request_id,
            [token],
            text,
            [logprob] if logprob else [],
            num_prompt_tokens=len(self.prompt_ids),
            num_output_tokens=len(self.output_ids),
            num_cached_tokens=self.num_cached_tokens or 0,
            prompt_logprobs=self.prompt_logprobs
            if len(self.output_ids) == 1 and self.params.prompt_logprobs is not None
            else None,
        )

    def _stops_on(self, token_id: int) -> bool:
        """The token just appended is a stop token (end-of-sequence unless ignore_eos, or one of stop_token_ids)
        that counts: not before min_tokens tokens (the sampler never draws one there: penalties.py)."""
        p = self.params
        if len(self.output_ids) < p.min_tokens:
            return False
        # under a grammar an EOS token is only ever its stop token, which ends it even with ignore_eos
        eos = token_id in self.eos_token_ids and (not p.ignore_eos or self.grammar is not None)
        return eos or token_id in p.stop_token_ids

    def check_stop(self, token_id: int, max_model_len: int) -> None:
        """Decide whether the token just appended ends the request (its grammar, if any, fed it first)."""
        p, grammar = self.params, self.grammar
        if grammar is not None:
            grammar.advance(self.output_ids)
        if grammar is not None and grammar.error is not None:
            self.finish_reason = FinishReason.ERROR
        elif self._stops_on(token_id):
            self.finish_reason, self.stop_reason = FinishReason.STOP, token_id
        elif self.detokenizer is not None and self.detokenizer.stopped_on is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, self.detokenizer.stopped_on
        elif grammar is not None and grammar.terminated:  # its stop token, which ignore_eos would pass
            self.finish_reason, self.stop_reason = FinishReason.STOP, token_id
        elif len(self.output_ids) >= p.max_tokens or len(self.prompt_ids) + len(self.output_ids) >= max_model_len:
            self.finish_reason = FinishReason.LENGTH


class RequestBuilder:
    """Makes requests from prompts for one engine (any thread; nothing of the engine's state is touched): the
    prompt tokenised, every check a worker makes on a request (`validate`), its detokenizer set up."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        max_model_len: int,
        kv_pool: KVPagePool,
        spare_tokens: int = 0,
    ):
        """`spare_tokens`: KV a request may write past its last token (speculative decoding: scheduler.py)."""
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.vocab_size, self.max_model_len, self.kv_pool = vocab_size, max_model_len, kv_pool
        self.spare_tokens = spare_tokens
        self.refuses_prompt_logprobs: str | None = None  # why this engine cannot serve them, where it cannot
        self._ids = itertools.count()

    def build(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, hold_state: bool = False
    ) -> Request:
        """RequestError when this engine cannot serve it as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; send token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        self.validate(prompt_ids, params)
        detok = IncrementalDetokenizer.for_params(self.tokenizer, prompt_ids, params) if self.tokenizer else None
        return Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt_ids,
            params=params,
            detokenizer=detok,
            eos_token_ids=self.eos_token_ids,
            hold_state=hold_state,
        )

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.vocab_size, self.max_model_len)
        if params.prompt_logprobs is not None and self.refuses_prompt_logprobs:
            raise RequestError(f"prompt_logprobs: {self.refuses_prompt_logprobs}")
        pages = self.kv_pool.pages_for(len(prompt_ids) + params.max_tokens + self.spare_tokens)
        if pages > self.kv_pool.num_pages:
            raise RequestError(
                f"request needs {pages} KV pages but this worker's pool has {self.kv_pool.num_pages}; "
                "lower max_tokens or shorten the prompt"
            )
