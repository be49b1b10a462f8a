"""Structured outputs on the GPU: the bitmask filled on the host, copied from pinned memory and applied by
xgrammar's Triton kernel, on a batch that mixes rows with and without a grammar (the kernel's row indices); the
outputs follow their schema, and are the same with and without async scheduling."""

import json
import threading

import jsonschema
import pytest

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, FinishReason, SamplingParams
from deltamesh.engine.engine import Completion
from deltamesh.protocol.structured import StructuredOutputs

pytestmark = pytest.mark.gpu
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
STRUCTURED = SamplingParams(max_tokens=400, temperature=0.8, seed=3, structured_outputs=StructuredOutputs(json=SCHEMA))
PLAIN = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
ASKS = [("The Python language", STRUCTURED), ("A list is", PLAIN), ("In this tutorial", STRUCTURED), ("Then", PLAIN)]


def run_together(engine: Engine, asks) -> list[Completion]:
    requests = [engine.make_request(prompt, params) for prompt, params in asks]
    results = {r.request_id: Completion(r.request_id, r.prompt_ids) for r in requests}
    done = threading.Semaphore(0)

    def sink(out):
        results[out.request_id].add(out)
        if out.finished:
            done.release()

    for r in requests:
        engine.submit(r, sink)
    for _ in requests:
        assert done.acquire(timeout=120)
    return [results[r.request_id] for r in requests]


def test_grammar_rows_and_plain_rows_in_one_cuda_batch():
    runs = []
    for async_scheduling in (False, True):
        cfg = EngineConfig(model=str(DEFAULT_MODEL), device="cuda", dtype="float32", async_scheduling=async_scheduling)
        with Engine(cfg) as engine:
            outs = run_together(engine, ASKS)
            assert engine.stats.grammar_mask_steps > 0
        for out, (_, params) in zip(outs, ASKS):
            if params is STRUCTURED:
                assert out.finish_reason == FinishReason.STOP
                jsonschema.validate(json.loads(out.text), SCHEMA)
            else:
                assert len(out.token_ids) == 24
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1]
