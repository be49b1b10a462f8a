"""The engine against transformers' own Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models (fp32, CPU), on tiny
random checkpoints that transformers wrote with save_pretrained and the engine read with its own loader."""

import copy

import pytest
import torch
from hf_checkpoints import VOCAB, load_hf
from idle_pools import assert_idle

from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore
from deltamesh.engine.engine import Engine
from deltamesh.engine.request import Request
from deltamesh.engine.scheduler import ScheduledItem

pytestmark = pytest.mark.fidelity
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def hf_model(hf_checkpoints, family):
    return load_hf(hf_checkpoints[family])


@pytest.fixture(scope="module")
def core(hf_checkpoints, family):
    return EngineCore(
        EngineConfig(model=str(hf_checkpoints[family]), page_size=8, max_num_seqs=8, max_num_batched_tokens=64)
    )


def prompt(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def engine_logits(core, ids, chunks):
    """Logits at every position, running `ids` through the engine in the given chunk sizes."""
    assert sum(chunks) == len(ids)
    req = Request("probe", ids, SamplingParams(), None)
    req.slot, req.pages = core.state_pool.alloc(), core.kv_pool.alloc(core.kv_pool.pages_for(len(ids)))
    out = []
    try:
        for n in chunks:
            input_ids, batch = core.runner.prepare([ScheduledItem(req, n)])
            hidden = core.model(input_ids, batch, core.kv_pool, core.state_pool, core.kernels)
            out.append(core.model.logits(hidden))
            req.num_computed += n
    finally:
        core.scheduler.free(req)
    return torch.cat(out)


def split(n, size):
    return [size] * (n // size) + ([n % size] if n % size else [])


def test_prompt_logits_match(core, hf_model):
    ids = prompt(48)
    assert (engine_logits(core, ids, [48]) - hf_logits(hf_model, ids)).abs().max() <= 1e-4


def test_prefill_then_decode_matches_full_forward(core, hf_model):
    ids = prompt(70, seed=1)
    chunks = [40] + [1] * 30  # prefill 40, then one token at a time
    assert (engine_logits(core, ids, chunks) - hf_logits(hf_model, ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_unchunked(core, chunk):
    ids = prompt(150, seed=2)
    whole = engine_logits(core, ids, [150])
    assert (engine_logits(core, ids, split(150, chunk)) - whole).abs().max() <= 1e-4


def assert_greedy_generation_matches(checkpoint, hf_model, ids: list[int], n: int) -> None:
    """The engine on `checkpoint` and transformers' `hf_model` generate the same n greedy tokens after `ids`."""
    with Engine(EngineConfig(model=str(checkpoint), page_size=8)) as eng:
        [res] = eng.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert res.token_ids == ref[0, len(ids) :].tolist()


def test_greedy_generation_matches_transformers(hf_checkpoints, family, hf_model):
    assert_greedy_generation_matches(hf_checkpoints[family], hf_model, prompt(41, seed=3), 32)


def test_continuous_batch_equals_each_request_alone(core, hf_model):
    """Requests join at different steps and leave at different lengths, with chunked prefills riding
    along with decodes in the same steps; each must equal its own solo run in transformers."""
    lengths = [5, 33, 1, 70, 12, 48, 20]
    max_tokens = [12, 7, 16, 5, 20, 9, 14]
    join_at_step = [0, 0, 2, 3, 3, 8, 15]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    requests = [core.make_request(prompt(n, seed=10 + i), p, f"r{i}") for i, (n, p) in enumerate(zip(lengths, params))]
    results = {r.request_id: [] for r in requests}
    finished = set()

    def sink(out):
        results[out.request_id] += out.new_token_ids
        if out.finished:
            finished.add(out.request_id)

    step = 0
    max_running = 0
    while len(finished) < len(requests):
        for r, at in zip(requests, join_at_step):
            if at == step:
                core.submit(r, sink)
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
        max_running = max(max_running, len(core.scheduler.running))
        step += 1
    assert max_running >= 4  # they really shared steps
    for r, m in zip(requests, max_tokens):
        ref = hf_model.generate(torch.tensor([r.prompt_ids]), max_new_tokens=m, min_new_tokens=m, do_sample=False)
        assert results[r.request_id] == ref[0, len(r.prompt_ids) :].tolist(), r.request_id
    assert_idle(core)


def test_bf16_weights_on_the_cpu_as_close_as_transformers_bf16(hf_checkpoints, family, hf_model):
    """`--dtype bfloat16` on the CPU (docs/serving.md, "Precision and FP8 checkpoints": the faster choice on a CPU
    with native bf16) against transformers' float32 model, over 200 positions of prefill + decode: no further from
    it than twice the distance of transformers' own model cast to bf16 (relative logit error), and the same
    greedy token at all but 5 % fewer positions than that bf16 model."""
    ids = prompt(200, seed=5)
    ref = hf_logits(hf_model, ids)
    hf_bf16 = hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16), ids).float()
    bf16 = EngineCore(EngineConfig(model=str(hf_checkpoints[family]), page_size=8, dtype="bfloat16"))
    assert bf16.model.embed.dtype == torch.bfloat16
    got = engine_logits(bf16, ids, [64, 64] + [1] * 72).float()

    def rel_err(x):
        return ((x - ref).norm() / ref.norm()).item()

    def same_argmax(x):
        return (x.argmax(-1) == ref.argmax(-1)).float().mean().item()

    print(f"{family}: bf16 rel err {rel_err(got):.2e} (transformers' bf16 {rel_err(hf_bf16):.2e})")
    assert 0 < rel_err(got) <= 2 * rel_err(hf_bf16)
    assert same_argmax(got) >= same_argmax(hf_bf16) - 0.05


def test_bf16_recurrent_state_within_tolerance(hf_checkpoints, family, core):
    """bf16 GDN state (half the bytes to store and move) stays close to fp32. Documented tolerance
    (docs/serving.md, "Precision and FP8 checkpoints"): over 200 positions of prefill + decode, relative error
    ||Δ|| / ||ref|| <= 5e-3 and max |Δlogit| <= 0.1 (logits here span about ±5)."""
    bf16 = EngineCore(EngineConfig(model=str(hf_checkpoints[family]), page_size=8, state_dtype="bfloat16"))
    ids = prompt(200, seed=4)
    chunks = [64, 64] + [1] * 72
    ref, got = engine_logits(core, ids, chunks), engine_logits(bf16, ids, chunks)
    diff = got - ref
    print(f"{family}: bf16 state rel err {(diff.norm() / ref.norm()).item():.2e}, max {diff.abs().max().item():.3f}")
    assert diff.norm() / ref.norm() <= 5e-3
    assert diff.abs().max() <= 0.1
    assert diff.abs().max() > 0  # the bf16 state really was used
