"""How an engine core is put together from its settings: the model's config and tokenizer, the leader's rank
(model, pools, kernels, runner: rank.py), a parallel engine's follower processes (tp_workers.py), the scheduler
and hand-off of its layout (one rank, tensor parallel, data parallel), then, once the core can step, the warm-up,
the CUDA graphs and the prefix cache, in that order: the warm-up runs (and compiles) every step shape before any
graph is captured, and its prompts must run in full, not from a cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from deltamesh.engine.cache import KVPagePool, StatePool
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.data_parallel import DataParallelHandoff, DataParallelScheduler, RankPools
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.held_states import HeldStates
from deltamesh.engine.interfaces import PrefixCacheInterface, SchedulerInterface
from deltamesh.engine.parallel import shard_config
from deltamesh.engine.prefix_cache import TURN_START, PrefixCache
from deltamesh.engine.rank import Rank, build_rank
from deltamesh.engine.request import RequestBuilder
from deltamesh.engine.reservations import Reservations
from deltamesh.engine.scheduler import Scheduler
from deltamesh.engine.stats import EngineStats
from deltamesh.engine.tokenizer import Tokenizer
from deltamesh.engine.tp_handoff import AreaSize, Handoff, TensorParallelHandoff
from deltamesh.engine.tp_workers import Followers, RankMemory, exports_rank_memory
from deltamesh.kernels import late_compiles
from deltamesh.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from deltamesh.engine.core import EngineCore

log = structlog.get_logger("deltamesh.engine")


@dataclass
class EngineParts:
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    followers: Followers | None  # ranks 1..N-1 of a parallel engine
    rank: Rank  # the leader's (this process's)
    rank_memory: dict[int, RankMemory]  # what each follower made readable of its pools, if the transport reads them
    scheduler: SchedulerInterface
    handoff: Handoff | None  # a parallel engine's
    request_builder: RequestBuilder
    reservations: Reservations  # space for arriving states
    held: HeldStates  # states kept for a puller


def assemble(config: EngineConfig, device: torch.device) -> EngineParts:
    """An engine core's parts on `device` (a parallel engine's follower processes started and joined)."""
    model_dir = Path(config.model)
    mc = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    max_model_len = config.resolved_max_model_len(mc.max_position_embeddings)
    # tensor parallelism and data-parallel attention: this process is rank 0, the followers are processes of
    # their own (tp_workers.py); a model that cannot be split fails here, before any rank starts
    shard_config(mc, config.num_ranks, config.enable_expert_parallel, data_parallel=config.data_parallel_size > 1)
    followers = Followers(config, mc) if config.num_ranks > 1 else None
    rank = build_rank(config, mc, max_model_len, device, followers.group if followers else None)
    # (exports_rank_memory: only an engine of several ranks, which has followers)
    rank_memory = followers.collect_rank_memory() if followers is not None and exports_rank_memory(config) else {}
    scheduler, handoff = leader_scheduling(config, followers, rank)
    eos_token_ids = tokenizer.eos_token_ids if tokenizer else frozenset(mc.eos_token_ids)
    spare = 3 * config.speculative_tokens  # Scheduler.spare_tokens
    builder = RequestBuilder(tokenizer, eos_token_ids, mc.vocab_size, max_model_len, rank.kv_pool, spare)
    reservations = Reservations(scheduler, handoff, rank.kv_pool, rank.state_pool, device, mc)
    data_parallel = config.data_parallel_size > 1
    if data_parallel:  # each rank's prompt rows would need gathering to the leader, as its logits are
        builder.refuses_prompt_logprobs = "not served by data-parallel workers (--data-parallel-size > 1)"
    held = HeldStates(scheduler, handoff, rank.kv_pool, rank.state_pool, rank_memory, data_parallel)
    return EngineParts(
        mc, tokenizer, max_model_len, followers, rank, rank_memory, scheduler, handoff, builder, reservations, held
    )


def leader_scheduling(config: EngineConfig, followers: Followers | None, rank: Rank) -> tuple:
    """(scheduler, hand-off or None) of an engine whose leader holds `rank`: one rank; tensor parallel, the
    leader's pool writes repeated by every follower; or data parallel, one scheduler per rank."""

    def scheduler(kv: KVPagePool, states: StatePool) -> Scheduler:
        made = Scheduler(kv, states, config.max_num_seqs, config.resolved_max_num_batched_tokens())
        made.speculative_tokens = config.speculative_tokens
        made.spec_disable_batch_size = config.resolved_spec_disable_batch_size()
        return made

    if followers is None:
        return scheduler(rank.kv_pool, rank.state_pool), None
    max_model_len = config.resolved_max_model_len(rank.model_config.max_position_embeddings)
    area = AreaSize.of(config.resolved_handoff_states(), max_model_len, rank.kv_pool, rank.state_pool)
    if config.data_parallel_size == 1:
        rank.runner.followers = followers
        mirrored: tuple[StatePool | KVPagePool | None, ...] = (rank.state_pool, rank.checkpoint_pool, rank.kv_pool)
        for pool in mirrored:
            if pool is not None:
                pool.mirror = followers.pool_ops
        return scheduler(rank.kv_pool, rank.state_pool), TensorParallelHandoff(
            followers, rank.kv_pool, rank.state_pool, area
        )
    pools = [RankPools(rank.kv_pool, rank.state_pool, rank.checkpoint_pool)]
    pools += [pools[0].bookkeeping(ops) for ops in followers.rank_ops[1:]]
    schedulers = [scheduler(p.kv, p.states) for p in pools]
    return DataParallelScheduler(schedulers, pools), DataParallelHandoff(followers, rank.kv_pool, rank.state_pool, area)


# Devices whose engines warm up before serving (warm_up): kernel compilation and autotuning happen there, not
# inside a client's request. CPU engines skip it: nothing compiles, and tests build hundreds of engines.
WARM_UP_DEVICES = ("cuda",)


def get_ready(core: EngineCore, config: EngineConfig, parts: EngineParts) -> None:
    """The last of building an engine: its prefix cache; on a GPU, then the warm-up (after the cache: without it no
    chunk takes a checkpoint in passing, and those steps' kernels would compile inside the first requests that
    do), the CUDA graphs and the watch for kernels compiled later (kernels/late_compiles.py); the ready line."""
    core.prefix_cache = core.launcher.prefix_cache = make_prefix_cache(config, parts, core.stats)
    if core.device.type in WARM_UP_DEVICES:
        warm_up(core)
        if config.cuda_graphs:
            capture_graphs(config, parts)
        late_compiles.WATCH.start()  # from here on a compile is one the warm-up missed
    log_ready(config, parts)


def warm_up(core: EngineCore) -> None:
    """Run each kind of step once: a prefill, then a mixed step (that request's decode next to four prefills,
    one a 2-token tail, two taking their checkpoints in passing: the scratch slot's and a free slot's, their
    tails in a pass of their own), a mixed step whose prompt has 32 tokens, then decodes, so that kernel
    compilation (CuTe DSL, Triton) and autotuning happen before the worker serves, not inside a client's request
    (a first use of a step shape can cost seconds; a colocated worker meets the mixed shape with its first
    concurrent requests). Chunks take checkpoints only with the prefix cache made, so get_ready makes it first;
    this clears it after. Counts nothing."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    longest = core.max_model_len - params.max_tokens  # a tiny max_model_len only shortens the prompts
    n = 2 * core.config.page_size + 1
    # The last wave's prompt has a multiple of 16 tokens, the others not: Triton specializes integer arguments by
    # it, and some kernels take the step's token count (FLA's gate kernel: tokens x heads).
    waves = ([n], [n - 1, n + 3, 2, n + 5], [32])
    token = 0
    for wave, lengths in enumerate(waves):
        for k in lengths:
            token += 1  # no two prompts share a prefix: none starts from the cache
            prompt = [token] * max(1, min(k, longest))
            core.submit(core.make_request(prompt, params, f"warm-up-{wave}-{token}"), lambda out: None)
        core.process_commands()
        core.step()
    while core.has_work:
        core.step()
    if core.prefix_cache is not None:  # nothing a client sent
        core.prefix_cache.clear()
    core.stats.reset()


def capture_graphs(config: EngineConfig, parts: EngineParts) -> None:
    """Decode graphs, and piecewise graphs for steps with prompt tokens, where they can run (CUDA)."""
    runner, followers, max_model_len = parts.rank.runner, parts.followers, parts.max_model_len
    if config.data_parallel_size > 1:
        log.warning("CUDA graphs off: data-parallel steps gather a varying number of tokens")
    elif parts.rank.kernels.chosen["paged_attention"] == "torch":
        log.warning("CUDA graphs off: the torch attention reference reads host lengths")
    else:
        if followers:
            followers.capture_decode_graphs(config.max_num_seqs, max_model_len)
        runner.capture_decode_graphs(config.max_num_seqs, max_model_len)
        piecewise = config.resolved_piecewise_max_tokens()
        if piecewise and followers:
            log.warning("piecewise CUDA graphs off: not built for tensor-parallel workers")
        elif piecewise:
            runner.capture_piecewise_graphs(piecewise)


def make_prefix_cache(config: EngineConfig, parts: EngineParts, stats: EngineStats) -> PrefixCacheInterface | None:
    """The prefix cache over the leader's pools, or one per rank under data parallelism; None when it is off."""
    if parts.rank.checkpoint_pool is None:
        return None
    turn_start = parts.tokenizer.token_id(TURN_START) if parts.tokenizer else None

    def make(kv: KVPagePool, states: StatePool, checkpoints: StatePool) -> PrefixCache:
        return PrefixCache(
            kv,
            states,
            checkpoints,
            stats,
            config.prefix_cache_pages,
            config.state_checkpoint_interval,
            turn_start,
            config.prefix_cache_memory_bytes(),
        )

    scheduler = parts.scheduler
    if isinstance(scheduler, DataParallelScheduler):
        return scheduler.attach_prefix_caches(make)
    assert isinstance(scheduler, Scheduler), "an engine of one scheduler, if not of one per data-parallel rank"
    scheduler.prefix_cache = make(parts.rank.kv_pool, parts.rank.state_pool, parts.rank.checkpoint_pool)
    return scheduler.prefix_cache


def log_ready(config: EngineConfig, parts: EngineParts) -> None:
    memory: dict[str, float | None] = {}
    if parts.rank.device.type == "cuda":  # what the worker holds after its warm-up and graphs, against its share
        memory["gpu_memory_gib"] = round(torch.cuda.memory_reserved(parts.rank.device) / 2**30, 2)
        memory["gpu_memory_utilization"] = config.gpu_memory_utilization
    kv_pool = parts.rank.kv_pool
    log.info(
        "engine ready",
        model=config.model,
        family=parts.model_config.family,
        device=str(parts.rank.device),
        dtype=str(parts.rank.dtype),
        kv_pages=kv_pool.num_pages,
        kv_cache_gib=round(kv_pool.num_pages * kv_pool.page_bytes / 2**30, 2),
        **memory,
        page_size=config.page_size,
        state_slots=config.max_num_seqs,
        max_model_len=parts.max_model_len,
        kernels=parts.rank.kernels.chosen,
    )
