"""Structured decoding against an independent implementation: transformers' own model of the default checkpoint,
generating greedily with xgrammar's logits processor for transformers, its grammar compiled from transformers'
tokenizer as xgrammar reads one. The engine's output under the same grammar is the same, token for token."""

import json

import pytest
import torch

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams
from deltamesh.engine.grammar import xgrammar
from deltamesh.protocol.structured import StructuredOutputs

pytestmark = pytest.mark.fidelity
# Values without free text: xgrammar's view of a Hugging Face tokenizer lets special tokens spell text, which the
# engine's never does (grammar.tokenizer_info), so a free string could differ where the model prefers one.
SCORE = {
    "type": "object",
    "properties": {"grade": {"enum": ["low", "mid", "high"]}, "points": {"type": "integer", "maximum": 99}},
    "required": ["grade", "points"],
    "additionalProperties": False,
}
MAX_TOKENS = 64  # more than any of these grammars allows
CASES = [
    ("json", StructuredOutputs(json=SCORE, disable_any_whitespace=True), "The score:"),
    ("regex", StructuredOutputs(regex="[a-z]{3,9}( [0-9]{1,4})?"), "Word and number:"),
    ("choice", StructuredOutputs(choice=["first answer", "second", "third one here"]), "Pick:"),
]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL / "tokenizer.json"))
    return model, tokenizer


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineConfig(model=str(DEFAULT_MODEL))) as e:
        yield e


def hf_grammar(tokenizer, vocab_size, eos, spec):
    xgr = xgrammar()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    if spec.kind == "json":
        return compiler.compile_json_schema(json.dumps(spec.json), any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.regex)
    return compiler.compile_grammar("root ::= " + " | ".join(f'"{c}"' for c in spec.choice))


@pytest.mark.parametrize("kind,spec,prompt", CASES, ids=[c[0] for c in CASES])
def test_greedy_structured_output_is_transformers_with_xgrammars_processor(hf, engine, kind, spec, prompt):
    model, tokenizer = hf
    eos = sorted(engine.core.request_builder.eos_token_ids)
    ids = engine.tokenizer.encode(prompt)
    processor = xgrammar().contrib.hf.LogitsProcessor(hf_grammar(tokenizer, model.config.vocab_size, eos, spec))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            logits_processor=[processor],
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    reference = out[0, len(ids) :].tolist()
    got = engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=spec))[0]
    assert got.token_ids == reference and reference[-1] in eos
