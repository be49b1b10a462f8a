"""vLLM's --seed (EngineConfig.seed): requests without a seed of their own sample the same tokens after a restart
with the same seed and others with another; dummy weights are the seed's, so it enters the workers' compat hash
there (and only there)."""

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.handoff import compat_hash

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
UNSEEDED = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)


def sampled(seed: int) -> list[list[int]]:
    with Engine(EngineConfig(model=str(DEFAULT_MODEL), seed=seed)) as engine:
        return [out.token_ids for out in engine.generate(PROMPTS, UNSEEDED)]


def test_unseeded_requests_follow_the_engines_seed():
    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_the_seed_counts_in_the_compat_hash_only_for_dummy_weights():
    model = ModelConfig.from_dir(DEFAULT_MODEL)

    def hashed(load_format: str, seed: int) -> str:
        return compat_hash(EngineConfig(model=str(DEFAULT_MODEL), load_format=load_format, seed=seed), model)

    assert hashed("dummy", 1) != hashed("dummy", 2)
    assert hashed("auto", 1) == hashed("auto", 2)
