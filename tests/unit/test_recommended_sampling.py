"""The checkpoint's recommended sampling as vLLM reads generation_config.json, and a bad recommendation refused when
the router starts."""

import json
import shutil

import pytest
from pydantic import ValidationError

from deltamesh.engine import DEFAULT_MODEL
from deltamesh.protocol.generation_defaults import sampling_defaults
from deltamesh.services.common import convert
from deltamesh.services.common.settings import RouterSettings
from deltamesh.services.router.frontend import Frontend


def with_config(tmp_path, config: dict):
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    (model / "generation_config.json").write_text(json.dumps(config))
    return model


def test_only_values_that_differ_from_transformers_defaults_are_recommendations(tmp_path):
    qwen = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [2], "pad_token_id": 0}
    model = with_config(tmp_path, qwen)
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults(model, "vllm") == {}
    spelled_out = with_config(tmp_path / "b", {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "max_new_tokens": 64})
    assert sampling_defaults(spelled_out) == {"max_tokens": 64}
    assert sampling_defaults(tmp_path / "no-such-dir") == {}
    # the server's overrides go over either source, taken as given (top_k 50 included)
    assert sampling_defaults(model, "auto", {"top_k": 50, "max_new_tokens": 9}) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 50,
        "max_tokens": 9,
    }
    assert sampling_defaults(model, "vllm", {"temperature": 0.2}) == {"temperature": 0.2}


def test_a_bad_recommendation_stops_the_router_at_start(tmp_path):
    model = with_config(tmp_path, {"top_p": 2.0})
    with pytest.raises(ValidationError, match=r"sampling defaults \(generation_config.json.*top_p"):
        RouterSettings(model=str(model), mesh_secret="s")
    assert RouterSettings(model=str(model), mesh_secret="s", generation_config="vllm").generation_config == "vllm"
    assert Frontend(str(model), generation_config="vllm").sampling_defaults == {}
    for overrides, says in (
        ('{"temprature": 0.5}', "cannot override temprature"),
        ("[1]", "must be a JSON object"),
        ("{", "is not JSON"),
        ('{"temperature": 9}', "temperature must be in"),
    ):
        with pytest.raises(ValidationError, match=says):
            RouterSettings(
                model=str(model), mesh_secret="s", generation_config="vllm", override_generation_config=overrides
            )


def test_grpc_fields_left_unset_take_the_recommendation_and_set_ones_win():
    sp, stop = convert.sampling_to_proto(convert.SamplingParams(temperature=0.5, top_k=0))
    for name in ("top_p", "min_p"):
        sp.ClearField(name)  # as a client that leaves them unset sends them
    params = convert.sampling_from_proto(sp, stop, {"temperature": 0.9, "top_p": 0.8, "top_k": 20, "min_p": 0.1})
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (
        0.5,
        pytest.approx(0.8),
        0,
        pytest.approx(0.1),
    )
