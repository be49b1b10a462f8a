"""A reduced draft vocabulary (--speculative-draft-vocab, spec/draft_vocab.py): the MTP drafter's argmax over only
the hot token ids. Greedy output is unchanged, token for token, whatever the hot set; every draft is a hot id (the
argmax over the hot rows mapped back to its full-vocabulary id, checked against the full head's logits restricted
to the hot set); sampled output keeps the model's distribution; bad settings are refused with the reason."""

import json
from collections import Counter

import pytest
import torch
from hf_checkpoints import VOCAB
from idle_pools import assert_idle
from test_spec_engine import FAMILIES, engine, prompts, run
from test_spec_sampling import N, assert_follows, sample_counts, sampling_case

from deltamesh.engine import EngineConfig
from deltamesh.engine.spec.draft_vocab import DraftHead, draft_vocab_ids
from deltamesh.engine.spec.drafter import MtpDrafter
from deltamesh.engine.spec.settings import parse_speculative_config

pytestmark = pytest.mark.spec


class RecordingDrafter(MtpDrafter):
    """The engine's MTP drafter, keeping every draft it proposes."""

    def __init__(self, head):
        super().__init__(head)
        self.proposed: list[int] = []

    def draft(self, ctx):
        drafts = super().draft(ctx)
        if drafts is not None:
            self.proposed += drafts.flatten().tolist()
        return drafts


def recording(core) -> RecordingDrafter:
    spec = core.runner.spec
    spec.drafter = RecordingDrafter(spec.drafter.head)
    return spec.drafter


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    """{family: greedy outputs of `prompts(4)` without speculative decoding}."""
    return {f: run(engine(hf_checkpoints[f], 0), prompts(4)) for f in FAMILIES}


def token_map(tmp_path, ids, kind: str) -> str:
    """A token map file of `ids`: SGLang's torch-saved tensor (.pt) or a JSON list (.json)."""
    path = tmp_path / f"hot.{kind}"
    if kind == "pt":
        torch.save(torch.tensor(ids), path)
    else:
        path.write_text(json.dumps(list(ids)))
    return str(path)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_with_a_reduced_draft_vocabulary_equals_greedy_output_without_mtp(
    hf_checkpoints, references, tmp_path, family, k
):
    """K = 1: the N lowest ids. K = 2, 3: a token map (.pt, .json) of the reference's K - 1 most frequent tokens,
    so that drafts (random MTP modules draft badly) are accepted where the reference repeats them, rejected
    elsewhere."""
    if k == 1:
        setting, hot = "100", set(range(100))
    else:
        frequent = Counter(t for out in references[family].values() for t in out).most_common(k - 1)
        hot = {t for t, _ in frequent}
        setting = token_map(tmp_path, sorted(hot), "pt" if k == 2 else "json")
    core = engine(hf_checkpoints[family], k, speculative_draft_vocab=setting)
    drafter = recording(core)
    assert run(core, prompts(4)) == references[family]
    assert core.stats.spec_drafts > 0 and set(drafter.proposed) <= hot
    if k > 1:
        assert core.stats.spec_accepted > 0
    assert_idle(core)


def test_drafts_are_the_hot_sets_argmax_mapped_back_to_full_vocabulary_ids(hf_checkpoints):
    """Against the full LM head's logits restricted to the hot set, with a hot set that leaves out every row's
    full-vocabulary argmax: the drafts differ from the full head's, and a draft that were the index into the hot
    rows (not its id) would be caught."""
    core = engine(hf_checkpoints["qwen3_5_moe"], 2)
    model = core.model
    hidden = torch.randn(16, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    logits = model.logits(hidden)
    full = logits.argmax(-1)
    hot = torch.tensor(sorted(set(range(1, VOCAB, 2)) - set(full.tolist())))
    drafts = DraftHead(model, hot).argmax(hidden)
    assert torch.equal(drafts, hot[logits[:, hot].argmax(-1)])
    assert set(drafts.tolist()) <= set(hot.tolist()) and not (drafts == full).any()


def test_no_draft_leaves_the_hot_set_in_a_whole_run(hf_checkpoints, references, tmp_path):
    """A hot set without any token of the greedy output and without any draft the full vocabulary gives: the
    engine drafts only hot ids, none is accepted, and the output is still the greedy output."""
    family = "qwen3_next"
    plain = engine(hf_checkpoints[family], 3)
    full = recording(plain)
    assert run(plain, prompts(4)) == references[family]
    outputs = {t for out in references[family].values() for t in out}
    hot = sorted(set(range(VOCAB)) - outputs - set(full.proposed))
    core = engine(hf_checkpoints[family], 3, speculative_draft_vocab=token_map(tmp_path, hot, "pt"))
    drafter = recording(core)
    assert run(core, prompts(4)) == references[family]
    assert drafter.proposed and set(drafter.proposed) <= set(hot)
    assert core.stats.spec_drafts > 0 and core.stats.spec_accepted == 0
    assert_idle(core)


def test_sampled_sequences_keep_the_models_distribution_with_a_reduced_draft_vocabulary(hf_checkpoints, tmp_path):
    """test_spec_sampling's chi-square test, the drafts the MTP module's argmax over a hot set of the greedy
    continuation's tokens and a few others: drafts are accepted where a sample follows them, rejected elsewhere."""
    path = hf_checkpoints["qwen3_5"]
    prompt, params, joint, greedy = sampling_case(path)
    hot = sorted(set(greedy) | {1, 2, 3})
    setting = token_map(tmp_path, hot, "pt")
    core = engine(path, 2, max_num_seqs=64, speculative_disable_batch_size=64, speculative_draft_vocab=setting)
    drafter = recording(core)
    assert_follows(sample_counts(core, prompt, params), joint)
    assert set(drafter.proposed) <= set(hot)
    assert core.stats.spec_drafts >= 2 * N and 0 < core.stats.spec_accepted < core.stats.spec_drafts


def test_the_speculative_config_json_carries_the_draft_vocabulary(hf_checkpoints, tmp_path):
    path = str(hf_checkpoints["qwen3_5"])
    config = EngineConfig(
        model=path, speculative_config='{"method": "mtp", "num_speculative_tokens": 2, "draft_vocab": 64}'
    )
    config.validate()
    assert (config.speculative_tokens, config.speculative_draft_vocab) == (2, "64")
    ids = token_map(tmp_path, [5, 1, 9], "json")
    config = EngineConfig(model=path, speculative_config=json.dumps({"num_speculative_tokens": 1, "draft_vocab": ids}))
    config.validate()
    assert config.speculative_draft_vocab == ids
    assert draft_vocab_ids(ids, VOCAB).tolist() == [1, 5, 9]  # sorted: ties go to the lowest id, as the full argmax's


@pytest.mark.parametrize(
    ("draft_vocab", "says"),
    [
        (0, "must be a count >= 1"),
        (-3, "must be a count >= 1"),
        (True, "must be a count of token ids"),
        ("", "must be a count of token ids"),
        ([1, 2], "must be a count of token ids"),
        (1.5, "must be a count of token ids"),
    ],
)
def test_a_malformed_draft_vocabulary_in_the_speculative_config_is_refused(draft_vocab, says):
    text = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "draft_vocab": draft_vocab})
    with pytest.raises(ValueError, match=f"speculative_config draft_vocab {says}"):
        parse_speculative_config(text)


def bad_maps(tmp_path) -> list[tuple[str, str]]:
    """(setting, what the refusal says) of each way a token map can be wrong."""
    cases = []
    for name, content, says in [
        ("out_of_range.pt", torch.tensor([1, VOCAB]), f"token id {VOCAB} is outside the model's vocabulary"),
        ("negative.pt", torch.tensor([-1, 4]), "token id -1 is outside"),
        ("repeated.pt", torch.tensor([3, 4, 3]), r"appear more than once \(e.g. \[3\]\)"),
        ("empty.pt", torch.tensor([], dtype=torch.int64), "the token map is empty"),
        ("two_d.pt", torch.zeros(2, 2, dtype=torch.int64), "must be a 1-D integer tensor of token ids, got a 2-D"),
        ("floats.pt", torch.tensor([1.0, 2.0]), "must be a 1-D integer tensor of token ids, got a 1-D torch.float32"),
        ("dict.pt", {"ids": [1]}, "got dict"),
        ("words.json", ["a", "b"], "must be a list of integer token ids"),
        ("duplicate.json", [7, 7], "appear more than once"),
    ]:
        path = tmp_path / name
        if name.endswith(".json"):
            path.write_text(json.dumps(content))
        else:
            torch.save(content, path)
        cases.append((str(path), says))
    (tmp_path / "broken.json").write_text("[1, 2")
    (tmp_path / "broken.pt").write_text("not a tensor")
    cases += [
        (str(tmp_path / "broken.json"), "not a JSON list of token ids"),
        (str(tmp_path / "broken.pt"), "not a torch-saved tensor of token ids"),
        (str(tmp_path / "missing.pt"), "no such file"),
        (str(VOCAB + 1), rf"a count of token ids must be in \[1, {VOCAB}\]"),
        ("0", "must be a count >= 1"),
    ]
    return cases


def test_a_bad_draft_vocabulary_is_refused_when_the_settings_are_checked(hf_checkpoints, tmp_path):
    path = str(hf_checkpoints["qwen3_5"])
    for setting, says in bad_maps(tmp_path):
        with pytest.raises(ValueError, match=says):
            EngineConfig(model=path, speculative_tokens=2, speculative_draft_vocab=setting).validate()
    with pytest.raises(ValueError, match="needs speculative_tokens"):
        EngineConfig(model=path, speculative_draft_vocab="64").validate()
    with pytest.raises(ValueError, match="speculative_draft_vocab '64' and speculative_config's draft_vocab '32'"):
        EngineConfig(
            model=path,
            speculative_draft_vocab="64",
            speculative_config='{"num_speculative_tokens": 2, "draft_vocab": 32}',
        ).validate()


def test_a_draft_vocabulary_is_refused_by_the_cli_in_one_line(hf_checkpoints):
    from test_cli_refusals import ROUTER_PORTS_LATER, refusal

    model = ["--model", str(hf_checkpoints["qwen3_5"]), *ROUTER_PORTS_LATER]
    assert refusal(["serve", "--speculative-tokens", "2", "--speculative-draft-vocab", "999999", *model]).endswith(
        f"speculative_draft_vocab 999999: a count of token ids must be in [1, {VOCAB}] (the vocabulary)"
    )


@pytest.mark.parametrize(
    "workers",
    [
        ["--prefill-workers", "1", "--decode-workers", "1"],
        ["--prefill-workers", "0", "--decode-workers", "1", "--colocated"],
    ],
)
def test_serve_hands_the_draft_vocabulary_to_every_worker(workers):
    from test_cli_refusals import serve_values

    from deltamesh.services import cli
    from deltamesh.services.common.options import SETTINGS_ENV

    values = serve_values(["--speculative-tokens", "3", "--speculative-draft-vocab", "32768", *workers])
    specs, _ = cli._children(values, "s" * 32, *cli._plan(values, "s" * 32))
    engines = [json.loads(s.env[SETTINGS_ENV])["engine"] for s in specs[1:]]
    assert engines and all(e["speculative_draft_vocab"] == "32768" for e in engines)


def test_steps_replayed_through_the_verify_graphs_parts_draft_from_the_hot_set(hf_checkpoints, references, tmp_path):
    """spec/graphs.py's two parts (the drafter's reduced head inside the second) on their static buffers, run as
    plain calls (capture=False: no GPU here): the tokens are unchanged and the drafts they leave are hot ids."""
    from deltamesh.engine.spec.graphs import VerifyGraphs

    family = "qwen3_5_moe"
    frequent = Counter(t for out in references[family].values() for t in out).most_common(2)
    hot = sorted(t for t, _ in frequent)
    core = engine(hf_checkpoints[family], 2, speculative_draft_vocab=token_map(tmp_path, hot, "pt"))
    spec = core.runner.spec
    spec.graphs = VerifyGraphs(
        spec, 8, core.kv_pool.pages_for(core.max_model_len + 6), buckets=(1, 2, 8), capture=False
    )
    assert run(core, prompts(4)) == references[family]
    assert core.runner.graph_steps > 5 and core.stats.spec_accepted > 0
    assert spec.graphs.drafts and all(set(d.flatten().tolist()) <= set(hot) for d in spec.graphs.drafts.values())
    assert_idle(core)


def test_the_memory_estimate_counts_the_draft_heads_copy_of_its_rows(hf_checkpoints):
    """memory_budget.estimate (what serve checks a budget with before loading) against the draft head an engine
    builds."""
    from test_memory_budget import footprint

    path = str(hf_checkpoints["qwen3_5_moe"])
    core = engine(path, 2, speculative_draft_vocab="200")
    head = core.runner.spec.drafter.head
    assert head.weight.shape == (200, core.model.cfg.hidden_size)
    whole = footprint(EngineConfig(model=path, speculative_tokens=2)).weights
    reduced = footprint(EngineConfig(model=path, speculative_tokens=2, speculative_draft_vocab="200")).weights
    assert reduced - whole == head.weight.numel() * head.weight.element_size()
