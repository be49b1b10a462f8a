"""The engine's MTP module (models/mtp.py), loaded by the engine's own loader from the `mtp.*` tensors of a
checkpoint, against a float64 reference of the published architecture built from transformers' own layers
(scripts/mtp_head.py: transformers does not implement MTP): the draft logits at every position
of a prompt run in chunks, its KV in the engine's paged pool."""

import pytest
import torch
from hf_checkpoints import VOCAB, load_hf, load_mtp_reference

from deltamesh.engine.cache import KVPagePool, StatePool
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.request import Request
from deltamesh.engine.runner import ModelRunner
from deltamesh.engine.sampling import SamplingParams
from deltamesh.engine.scheduler import ScheduledItem
from deltamesh.engine.weights import WeightError, load_model
from deltamesh.kernels import ModelShapes, select_kernels

pytestmark = pytest.mark.fidelity
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def reference_draft_logits(path, ids: list[int], next_token: int) -> torch.Tensor:
    """float64: the MTP's logits at every position of `ids`, position p reading token p+1 (the last: next_token)."""
    model = load_hf(path).double()
    model.config._experts_implementation = "eager"  # the grouped GEMM has no float64
    mtp = load_mtp_reference(model, path).double()
    for m in mtp.modules():
        if hasattr(m, "config"):
            m.config._experts_implementation = "eager"
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
        g = mtp(model, torch.tensor(ids[1:] + [next_token]), hidden, torch.arange(len(ids)))
        return model.lm_head(g)


@torch.inference_mode()
def engine_draft_logits(path, ids: list[int], next_token: int, chunks: list[int]) -> torch.Tensor:
    mc = ModelConfig.from_dir(path)
    dev = torch.device("cpu")
    model = load_model(mc, path, dev, torch.float32, mtp=True)
    kv = KVPagePool(32, 8, len(mc.full_layers) + mc.mtp_layers, mc.num_key_value_heads, mc.head_dim, torch.float32, dev)
    states = StatePool(
        2,
        len(mc.linear_layers),
        mc.conv_dim,
        mc.linear_conv_kernel_dim,
        mc.linear_num_value_heads,
        mc.linear_key_head_dim,
        mc.linear_value_head_dim,
        torch.float32,
        torch.float32,
        dev,
    )
    heads = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    heads += ("num_attention_heads", "num_key_value_heads", "head_dim")
    kernels = select_kernels(dev, ModelShapes(torch.float32, torch.float32, *(getattr(mc, f) for f in heads), 8))
    runner = ModelRunner(model, kv, states, kernels, dev)
    req = Request("probe", ids, SamplingParams(), None)
    req.slot, req.pages = states.alloc(), kv.alloc(kv.pages_for(len(ids)))
    out, start = [], 0
    for n in chunks:
        input_ids, batch = runner.prepare([ScheduledItem(req, n)])
        hidden = model(input_ids, batch, kv, states, kernels)
        following = torch.tensor(ids[start + 1 : start + n + 1] + ([next_token] if start + n == len(ids) else []))
        out.append(model.logits(model.mtp(model, following, hidden, batch, kv, kernels)))
        req.num_computed += n
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_draft_logits_match_the_reference(hf_checkpoints, family):
    path = hf_checkpoints[family]
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = reference_draft_logits(path, ids, next_token=7)
    got = engine_draft_logits(path, ids, 7, chunks=[9, 12])
    assert got.shape == ref.shape
    assert (got.double() - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_checkpoint_without_mtp_is_refused_with_a_reason(tmp_path):
    from hf_checkpoints import write_checkpoint

    path = write_checkpoint("qwen3_5", tmp_path / "plain", seed=9, mtp=False)
    with pytest.raises(WeightError, match="does not ship it"):
        load_model(ModelConfig.from_dir(path), path, torch.device("cpu"), torch.float32, mtp=True)
