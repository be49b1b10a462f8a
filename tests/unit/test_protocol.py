"""deltamesh/protocol: one set of sampling defaults (the wire's unset fields are the dataclass's defaults, both
ways), every field through protobuf and back, and a router that imports no torch."""

import dataclasses
import subprocess
import sys

from deltamesh.protocol.sampling import SamplingParams
from deltamesh.services.common import convert
from deltamesh.v1 import common_pb2


def test_an_unset_wire_field_is_the_dataclass_default():
    defaults = SamplingParams()
    assert convert.sampling_from_proto(common_pb2.SamplingParams(), common_pb2.StopConditions()) == defaults
    sp, stop = convert.sampling_to_proto(defaults)
    for name in convert._PLAIN:  # sent always: their zero value must be the default
        assert getattr(common_pb2.SamplingParams(), name) == getattr(defaults, name), name
    covered = {
        *convert._PLAIN,
        *convert._OPTIONAL,
        "logit_bias",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
    }
    assert covered == {f.name for f in dataclasses.fields(SamplingParams)}  # a new field must travel


def test_every_field_survives_the_wire():
    p = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.25,
        top_k=3,
        min_p=0.125,
        seed=2**63 + 5,
        stop=["a", "\n\n"],
        stop_token_ids=[4, 9],
        ignore_eos=True,
        logprobs=0,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        repetition_penalty=1.25,
        presence_penalty=-1.5,
        frequency_penalty=0.75,
        logit_bias={3: -100.0, 2**31: 0.5},
        min_tokens=2,
    )  # float32-exact values: the wire's floats are 32-bit
    assert convert.sampling_from_proto(*convert.sampling_to_proto(p)) == p
    off = convert.sampling_from_proto(*convert.sampling_to_proto(SamplingParams(top_k=-1)))
    assert off.top_k == 0  # vLLM's -1 travels as 0: both are off


def test_the_router_imports_no_torch():
    """A fresh interpreter: the router's process (its main module, the gateway, the frontend, the policies) and the
    protocol package load without torch (the started process is checked too: tests/e2e/test_api_sampling.py)."""
    code = (
        "import sys, deltamesh.services.router.main, deltamesh.protocol.requests, deltamesh.protocol.blocks; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
