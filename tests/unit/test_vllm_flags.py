"""A vLLM command from a model card with `vllm serve` replaced by `deltamesh serve`: the model as a positional
argument, vLLM's names for deltamesh's settings filling those settings, the flags deltamesh honours by design
accepted, a value it cannot honour refused in one line naming the flag before anything starts; and vLLM's
--chat-template, read as vLLM reads it and refused at start when it does not parse. Every command that should get
past its flags names a model directory that does not exist, so it stops at the model check instead of starting a
mesh."""

import pytest
import typer
from test_cli_refusals import ROUTER_PORTS_LATER
from typer.testing import CliRunner

from deltamesh.engine.chat_template import load_chat_template
from deltamesh.services import cli
from deltamesh.services.common.options import settings_from
from deltamesh.services.common.settings import RouterSettings, WorkerSettings

SECRET = "s" * 32
# Qwen3.5's model card, model path aside; the ports the tests' own (0: free ones, or the REST gateway off)
MODEL_CARD_FLAGS = [
    "--tensor-parallel-size",
    "1",
    "--max-model-len",
    "2048",
    "--reasoning-parser",
    "qwen3",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "qwen3_coder",
    "--enable-prefix-caching",
    "--trust-remote-code",
    "--language-model-only",
    "--speculative-config",
    '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}',
]
ENV_MODEL = "/no-such-model-in-the-environment"


@pytest.fixture
def missing_model(tmp_path) -> str:
    return str(tmp_path / "no-such-model")


def params(argv: list[str]) -> dict:
    command = typer.main.get_command(cli.app).commands[argv[0]]
    return dict(command.make_context(argv[0], argv[1:]).params)


def run(argv: list[str]):
    """`deltamesh ARGV`, its environment naming another missing model: a command that loses the model it was given
    stops at the model check too (naming the wrong one), instead of starting a mesh of the default model."""
    return CliRunner().invoke(cli.app, argv, env={"DELTAMESH_MESH_SECRET": SECRET, "DELTAMESH_MODEL": ENV_MODEL})


def refusal(argv: list[str]) -> str:
    """The one line `deltamesh ARGV` refuses with (exit status 2)."""
    result = run(argv)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, (argv, result.exit_code, result.stderr, result.exception)
    assert lines[0].startswith(f"deltamesh {argv[0]}: "), lines
    return lines[0]


def test_the_model_cards_command_gets_past_every_flag_to_its_model(missing_model):
    # MODEL, not $DELTAMESH_MODEL: a command line's value over the environment's
    line = refusal(["serve", missing_model, *ROUTER_PORTS_LATER, *MODEL_CARD_FLAGS])
    assert line == f"deltamesh serve: {missing_model}: no config.json (expected a Hugging Face checkpoint directory)"


def test_the_model_given_twice_must_be_one_checkpoint(missing_model):
    result = run(["serve", missing_model, "--model", "/elsewhere"])
    assert result.exit_code == 2
    assert f"Invalid value for MODEL / --model: {missing_model} and --model /elsewhere name two checkpoints" in (
        result.stderr
    )
    # the same checkpoint spelled two ways is one
    line = refusal(["serve", missing_model, "--model", f"{missing_model}/../no-such-model", *ROUTER_PORTS_LATER])
    assert line.startswith(f"deltamesh serve: {missing_model}: no config.json")


def worker_settings(argv: list[str]) -> WorkerSettings:
    return settings_from(WorkerSettings, cli.WORKER, params(argv), role="prefill", mesh_secret=SECRET)


def test_vllms_names_fill_deltameshs_settings():
    values = params(["serve", "--port", "9000", "--block-size", "32", "--enforce-eager", "--no-enable-prefix-caching"])
    router, _ = cli._plan(values, SECRET)
    engine = settings_from(WorkerSettings, cli.WORKER, values, role="prefill", mesh_secret=SECRET).engine
    assert (router.http_port, router.page_size, engine.page_size) == (9000, 32, 32)
    assert not engine.cuda_graphs and not engine.prefix_cache
    engine = worker_settings(["serve", "--enable-prefix-caching"]).engine
    assert engine.cuda_graphs and engine.prefix_cache
    # the router and the workers alone take them too; a worker's --port stays its gRPC port
    router = settings_from(
        RouterSettings, cli.ROUTER, params(["router", "--port", "9001", "--block-size", "64"]), mesh_secret=SECRET
    )
    assert (router.http_port, router.page_size) == (9001, 64)
    worker = worker_settings(["prefill", "--port", "7", "--block-size", "64", "--enforce-eager"])
    assert (worker.port, worker.engine.page_size, worker.engine.cuda_graphs) == (7, 64, False)


@pytest.mark.parametrize(
    "flags",
    [
        ["--kv-cache-dtype", "auto"],
        ["--generation-config", "vllm"],
        ["--enable-chunked-prefill"],
        ["--disable-custom-all-reduce"],
        ["--disable-uvicorn-access-log", "--uvicorn-log-level", "debug"],
        ["--pipeline-parallel-size", "1", "--distributed-executor-backend", "mp"],
        ["--mm-encoder-tp-mode", "data", "--limit-mm-per-prompt", '{"image": 0, "video": {"count": 0}}'],
        ["--disable-log-requests", "--disable-log-stats", "--max-logprobs", "5", "--seed", "42"],
        ["--enable-log-requests", "--default-chat-template-kwargs", '{"enable_thinking": false}'],
    ],
)
def test_values_deltamesh_honours_are_accepted(flags, missing_model):
    assert refusal(["serve", "--model", missing_model, *ROUTER_PORTS_LATER, *flags]).endswith(
        "no config.json (expected a Hugging Face checkpoint directory)"
    )


@pytest.mark.parametrize(
    "flags, says",
    [
        (
            ["--no-enable-chunked-prefill"],
            "--no-enable-chunked-prefill: deltamesh always prefills a long prompt in chunks of --max-num-batched-tokens "
            "tokens; leave the flag out",
        ),
        (
            ["--kv-cache-dtype", "fp8"],
            "--kv-cache-dtype fp8: the KV cache is kept in the model's dtype (--dtype); only auto is accepted",
        ),
        (
            ["--generation-config", "/some/folder"],
            "--generation-config /some/folder: input should be 'auto' or 'vllm'",
        ),
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: deltamesh splits a model by tensor"),
        (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray: each tensor-parallel rank"),
        (["--limit-mm-per-prompt", '{"image": 1}'], '--limit-mm-per-prompt {"image": 1}: deltamesh serves text only'),
        (["--max-logprobs", "-1"], "--max-logprobs -1: 0 to 20: deltamesh returns at most 20"),
        (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs [1]: must be a JSON object"),
        (
            ["--default-chat-template-kwargs", '{"tools": []}'],
            '--default-chat-template-kwargs {"tools": []}: cannot set tools',
        ),
    ],
)
def test_a_value_deltamesh_cannot_honour_is_refused_in_one_line(flags, says, missing_model):
    assert refusal(["serve", "--model", missing_model, *flags]).startswith(f"deltamesh serve: {says}")


def test_a_chat_template_is_a_file_or_the_template_on_one_line(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}\\n{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()  # a file's text as it is: jinja reads its escapes
    one_line = "{% for m in messages %}[{{ m['content'] }}]\\n{% endfor %}你"
    assert load_chat_template(one_line) == "{% for m in messages %}[{{ m['content'] }}]\n{% endfor %}你"


@pytest.mark.parametrize("command", ["router", "serve"])
def test_a_chat_template_that_does_not_parse_stops_the_start(command, missing_model, tmp_path):
    line = refusal([command, "--model", missing_model, "--chat-template", "{% for m in messages %}"])
    assert (
        "--chat-template {% for m in messages %}: the chat template does not parse: Unexpected end of template" in line
    )
    missing = tmp_path / "template.jinja"
    line = refusal([command, "--model", missing_model, "--chat-template", str(missing)])
    assert line.endswith(f"--chat-template {missing}: cannot read the chat template file: No such file or directory")


def test_tokenizer_may_name_the_checkpoint_only(missing_model):
    # the served checkpoint, spelled either way: past the flag, to the model check
    for spelled in (missing_model, f"{missing_model}/../no-such-model"):
        line = refusal(["serve", missing_model, "--tokenizer", spelled, *ROUTER_PORTS_LATER])
        assert line.startswith(f"deltamesh serve: {missing_model}: no config.json")
    result = run(["serve", "--model", missing_model, "--tokenizer", "/elsewhere", *ROUTER_PORTS_LATER])
    assert result.exit_code == 2
    assert "Invalid value for --tokenizer: /elsewhere: the tokenizer and chat template are read from" in result.stderr
