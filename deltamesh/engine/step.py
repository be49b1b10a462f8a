"""One step on the device, launched without waiting for it, in stages: the forward pass over the scheduled items
(one rank, tensor parallel, or every data-parallel rank's own requests: `_forward`), the requests' progress and
what the prefix cache takes from it (`_advance`), sampling (`_sample`); later, once the next step is launched,
its tokens on the host (`LaunchedStep.read`). The step loop around it is core.py.

Between the forward pass and sampling, the logits stage: first grammar bitmasks (structured outputs, grammar.py), in
place, so that the log-probabilities a request asks for are of the masked distribution, as vLLM's are; then
penalties, logit_bias and min_tokens (penalties.py, their per-request state on the device), which log-probabilities
do not see (vLLM's default too). A speculative engine (engine/spec/) verifies drafted tokens inside the forward pass
of every rank (the leader's acceptance in place of `_sample`: spec/accept.py, whose logits are a row per verified
position), its one to K+1 new tokens per request returned by `read`; the leader runs the grammar masks and the
logits stage there, over every verified position (spec/runner.py `_accept`, `_spec_sampling` below).

Bitmasks run only in a step where some sampled row has a grammar: a row's mask depends on the token its request
sampled in the step before, which under async scheduling reaches the host only now, so the step's caller takes those
tokens first (`before_masks`), while the device runs the forward pass queued above; the masks are then filled on the
host and applied on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltamesh.engine import data_parallel
from deltamesh.engine.grammar import GrammarMasks
from deltamesh.engine.interfaces import PrefixCacheInterface, SchedulerInterface
from deltamesh.engine.penalties import LogitAdjustments
from deltamesh.engine.prompt_logprobs import StepPromptLogprobs
from deltamesh.engine.request import Request, TokenLogprobs
from deltamesh.engine.runner import ModelRunner
from deltamesh.engine.sampling import SampledTokens, sample_async
from deltamesh.engine.scheduler import ScheduledItem
from deltamesh.engine.spec import tokens as spec_tokens
from deltamesh.engine.spec.runner import SpecSampling
from deltamesh.engine.spec.tokens import SpecTokens
from deltamesh.engine.stats import EngineStats
from deltamesh.engine.tp_workers import Followers


@dataclass
class LaunchedStep:
    """A launched step: the requests that sample in it (in row order) and their tokens on the way; on CUDA, events
    around its forward pass (the GPU's time on it: step_report.py)."""

    requests: list[Request]
    sampled: SampledTokens | SpecTokens
    span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    taken: bool = False  # its tokens went into their requests during the next step's launch (EngineCore._take_early)
    prompt: StepPromptLogprobs | None = None  # the prompt logprobs its prompt chunks give (prompt_logprobs.py)

    def read(self, stats: EngineStats) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """The step's new tokens (and logprobs) on the host, per request in row order; waits for the device. A
        speculative step's requests have their accepted drafts counted as computed first (spec/tokens.settle), and
        its prompt logprobs go to their requests before (a request's first output carries them)."""
        if self.prompt is not None:
            self.prompt.deliver()
        if isinstance(self.sampled, SpecTokens):
            tokens, logprobs, advanced, drafts = self.sampled.result()
            spec_tokens.settle(self.requests, tokens, advanced, drafts, self.sampled.num_verify, stats)
        else:
            token_list, logprob_list = self.sampled.result()
            tokens, logprobs = [[t] for t in token_list], [[lp] for lp in logprob_list]
        if self.span is not None:
            self.span[1].synchronize()  # returns at once: both events precede the tokens' copy on the stream
            stats.gpu_step_ms += self.span[0].elapsed_time(self.span[1])
        return list(zip(tokens, logprobs))


class StepLauncher:
    def __init__(
        self,
        runner: ModelRunner,
        followers: Followers | None,
        scheduler: SchedulerInterface,
        stats: EngineStats,
        device: torch.device,
        seed: int,
        data_parallel: bool,
    ):
        self.runner, self.followers, self.scheduler, self.stats = runner, followers, scheduler, stats
        self.data_parallel = data_parallel
        self.max_model_len = 0  # the context limit, set by its engine: speculative acceptance cuts a run there
        self.gpu_timed = device.type == "cuda"  # each step's GPU time (EngineStats.gpu_step_ms)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.prefix_cache: PrefixCacheInterface | None = None  # set by assembly.get_ready (before the warm-up)
        self.adjustments = LogitAdjustments(runner.model.cfg.vocab_size, device)
        self.masks = GrammarMasks()

    def launch(
        self,
        items: list[ScheduledItem],
        previous: LaunchedStep | None,
        between_layers: Callable[[], None] | None,
        before_masks: Callable[[list[Request]], None] | None = None,
    ) -> LaunchedStep:
        """Queue the step on the device; `previous`: the step launched before, whose tokens this one's decodes take
        as inputs on the device; `between_layers`: called between the forward pass's layers (one rank only);
        `before_masks`: called with the sampled requests before their grammars mask the logits (when one has a
        grammar), to bring their matchers up to date."""
        # decode-first (verifying items first), as kernels expect; the chunks that take a state in passing last
        # (runner.host_step)
        items.sort(key=lambda it: (it.request.dp_rank, not it.verify, it.num_tokens != 1, it.snapshot_at is not None))
        started = time.monotonic()
        span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.gpu_timed else None
        if span:
            span[0].record()
        sampling = [it.request for it in items if it.samples]  # before `_advance` moves the requests on
        spec_runner = self.runner.spec
        spec = self._spec_sampling(items, sampling, before_masks) if spec_runner is not None else None
        out = self._forward(items, previous, between_layers, spec)
        prompt = StepPromptLogprobs.of(self.runner.take_prompt_logprobs(), items)
        if span:
            span[1].record()
        self._advance(items, started)
        sampled: SpecTokens | SampledTokens
        if spec_runner is not None and spec is not None:  # accepted inside the forward pass (spec/runner.py)
            sampled = SpecTokens(out, sampling, sum(it.verify for it in items), spec_runner.k)
            self._pending(sampling)
        else:
            if any(r.grammar is not None for r in sampling):
                if before_masks is not None:
                    before_masks(sampling)
                self.stats.grammar_mask_seconds += self.masks.apply(out, sampling)
                self.stats.grammar_mask_steps += 1
            sampled = self._sample(out, sampling)
        self.stats.steps += 1
        return LaunchedStep(sampling, sampled, span, prompt=prompt)

    def _spec_sampling(
        self, items: list[ScheduledItem], sampling: list[Request], before_masks: Callable[[list[Request]], None] | None
    ) -> SpecSampling:
        """A speculative step drafts unless it backed off (its decodes run without verification at a large
        batch: scheduler.py). Its grammars mask its logits inside the forward pass, before the acceptance, their
        matchers brought up to date there (the drafts they follow are on the host once the step before is read);
        on a tensor-parallel engine before the forward pass instead: reading a step may hand a held state to the
        followers, a collective that must not come between the step's own."""
        backed_off = any(not it.verify and it.num_tokens == 1 and it.request.output_ids for it in items)
        inputs = spec_tokens.accept_inputs(sampling, self.max_model_len)
        spec = SpecSampling(inputs, self.generator, sampling, draft=not backed_off, adjustments=self.adjustments)
        if any(r.grammar is not None for r in sampling):
            if before_masks is not None and self.followers is not None:
                before_masks(sampling)
                before_masks = None

            def masks(logits: torch.Tensor, num_verify: int, width: int) -> None:
                if before_masks is not None:
                    before_masks(sampling)
                self.stats.grammar_mask_seconds += self.masks.apply(logits, sampling, (num_verify, width))
                self.stats.grammar_mask_steps += 1

            spec.masks = masks
        return spec

    def _forward(
        self,
        items: list[ScheduledItem],
        previous: LaunchedStep | None,
        between_layers: Callable[[], None] | None,
        spec: SpecSampling | None = None,
    ):
        """The forward pass: the logits of the items' sampled rows (in `items` order); a speculative engine's
        outputs (spec/runner.py)."""
        pending = previous.sampled.tokens if previous is not None else None
        if self.data_parallel:
            return data_parallel.execute(self.runner, self.followers, items, pending)
        if spec is None:
            return self.runner.execute(items, pending, between_layers=between_layers)
        return self.runner.execute(items, pending, between_layers=between_layers, sampling=spec)

    def _advance(self, items: list[ScheduledItem], started: float) -> None:
        """The items' requests have their tokens computed (once the step runs): their counts, and the prompt pages
        and checkpoints the prefix cache takes from them (queued after the step: they read what it writes)."""
        mixed = False
        for it in items:
            req = it.request
            if req.scheduled_time is None and req.arrival_time is not None:
                req.scheduled_time = started
                self.stats.queue_seconds += started - req.arrival_time
                self.stats.queued += 1
            in_prompt = req.num_computed < len(req.prompt_ids)
            mixed |= in_prompt
            req.num_computed += 1 if it.verify else it.num_tokens  # the drafts it accepts: when read
            req.verifying = it.verify
            if req.num_computed <= len(req.prompt_ids):
                self.stats.prompt_tokens += it.num_tokens
            if in_prompt and self.prefix_cache is not None:
                self.prefix_cache.register(req, it.snapshot_at, it.snapshot_slot)
        self.scheduler.release_snapshot_slots(items)
        self.stats.mixed_steps += mixed

    def _sample(self, logits: torch.Tensor, sampling: list[Request]) -> SampledTokens:
        """One token per row of `logits` (the rows of `sampling`, in order), on the device; the requests count it
        as pending until it is read."""
        adjusted, counting = self.adjustments.apply(logits, sampling)  # penalties, logit_bias, min_tokens
        sampled = sample_async(
            adjusted,
            [r.params for r in sampling],
            [len(r.output_ids) + r.num_pending for r in sampling],
            self.generator,
            raw_logits=logits,
        )
        self.adjustments.count(counting, sampled.tokens)
        self._pending(sampling)
        return sampled

    @staticmethod
    def _pending(sampling: list[Request]) -> None:
        for row, req in enumerate(sampling):
            req.num_pending += 1
            req.pending_row = row
