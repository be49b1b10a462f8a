"""Prefill and decode workers of different tensor-parallel layouts, as real processes (gRPC, state over UCX): every
pair of a one-rank and a two-rank prefill worker with a one-rank and a two-rank decode worker (expert parallel
on the MoE model) hands requests over exactly: greedy tokens as the monolithic one-rank engine's, fp32. A
two-rank prefill worker's states are read where its ranks hold them, as rank parts the decode worker merges. A
state whose sender's layout cannot hold the model is refused before any byte moves."""

import itertools

import grpc
import pytest
from harness import start_mesh
from hf_checkpoints import VOCAB, write_replicated_kv_checkpoint

from deltamesh.engine import Engine, EngineConfig, SamplingParams
from deltamesh.v1 import common_pb2, decode_pb2, prefill_pb2, ucx_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.parallel]
ENGINE = {"page_size": 8, "max_num_seqs": 4, "max_num_batched_tokens": 48, "num_kv_pages": 64}
WORKER_ARGS = ["--page-size", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "48", "--num-kv-pages", "64"]
SAMPLING = common_pb2.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# The longest lease a worker grants (--max-lease-ttl): a decode worker's first pull from a two-rank worker sets up
# its side channel to each rank first, which on a 2-core machine shared with other work outlasted the 30 s default.
LEASE_TTL_MS = 300_000
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(n)] for n in (5, 37, 61)]  # one page, several, chunked (48)


def layouts_mesh(model, log_dir, two_ranks: list[str]):
    """Router, a one-rank and a two-rank prefill worker, a one-rank and a two-rank decode worker."""
    mesh = start_mesh(model, log_dir, prefill=0, decode=0, worker_args=WORKER_ARGS)
    try:
        for role in ("prefill", "decode"):
            mesh.start_worker(role)
            mesh.start_worker(role, ["--tensor-parallel-size", "2", *two_ranks])
        mesh.wait_ready()
    except BaseException:
        mesh.stop()
        raise
    return mesh


def prefill(worker, rid: str, prompt: list[int]) -> prefill_pb2.PrefillResponse:
    request = prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING, lease_ttl_ms=LEASE_TTL_MS
    )
    return worker.stub().Prefill(request, timeout=60)


def decode(worker, rid: str, prompt: list[int], first: prefill_pb2.PrefillResponse, layout=None) -> list[int]:
    source = decode_pb2.TransferSource(
        lease=first.lease,
        transport=first.transport,
        layout=layout or first.layout,
        first_token_id=first.first.token_ids[0],
    )
    request = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING, source=source)
    return [t for delta in worker.stub().Decode(request, timeout=60) for t in delta.token_ids]


def one_rank_tokens(model) -> list[list[int]]:
    params = SamplingParams(max_tokens=SAMPLING.max_tokens, temperature=0, ignore_eos=True)
    with Engine(EngineConfig(model=str(model), torch_threads=1, **ENGINE)) as engine:
        return [c.token_ids for c in engine.generate(PROMPTS, params)]


def check_every_pair(mesh, want: list[list[int]]) -> None:
    prefills, decodes = mesh.workers("prefill"), mesh.workers("decode")
    for (p, prefill_worker), (d, decode_worker) in itertools.product(enumerate(prefills, 1), enumerate(decodes, 1)):
        for i, prompt in enumerate(PROMPTS):
            rid = f"p{p}-d{d}-{i}"
            first = prefill(prefill_worker, rid, prompt)
            assert first.layout.tensor_parallel_size == p and first.layout.rank_parts == (p > 1)  # read in place
            got = list(first.first.token_ids) + decode(decode_worker, rid, prompt, first)
            assert got == want[i], f"prefill over {p} rank(s) -> decode over {d} rank(s), prompt {i}"
    assert mesh.wait_idle() == {}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_prefill_and_decode_of_every_pair_of_layouts_match_the_one_rank_engine(hf_checkpoints, tmp_path, family):
    """Qwen3.5 dense with one KV head (replicated on two ranks); Qwen3.5-MoE with its experts split whole between
    the two ranks (expert parallel); Qwen3-Next. Through the router too, which passes the layout on unread."""
    model = write_replicated_kv_checkpoint(tmp_path / "model") if family == "qwen3_5" else hf_checkpoints[family]
    want = one_rank_tokens(model)
    mesh = layouts_mesh(str(model), tmp_path, ["--enable-expert-parallel"] if family == "qwen3_5_moe" else [])
    try:
        check_every_pair(mesh, want)
        with mesh.client() as client:
            assert [
                client.generate(p, max_tokens=10, temperature=0, ignore_eos=True).token_ids for p in PROMPTS
            ] == want
        assert mesh.wait_idle() == {}
    finally:
        mesh.stop()


def test_a_sender_layout_that_cannot_hold_the_model_is_refused_before_any_byte_moves(hf_checkpoints, tmp_path):
    model = hf_checkpoints["qwen3_5"]  # 2 KV heads and 2 GDN key heads: no layout of 3 or 4 ranks
    mesh = start_mesh(str(model), tmp_path, prefill=1, decode=1, worker_args=WORKER_ARGS)
    try:
        prefill_worker, decode_worker = mesh.workers("prefill")[0], mesh.workers("decode")[0]
        prompt = PROMPTS[1]
        first = prefill(prefill_worker, "r", prompt)
        for ranks in (3, 4):
            forged = common_pb2.StateLayout()
            forged.CopyFrom(first.layout)
            forged.tensor_parallel_size = ranks
            with pytest.raises(grpc.RpcError) as e:
                decode(decode_worker, "r", prompt, first, forged)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"sender's layout does not fit this model: cannot split this model into {ranks}" in e.value.details()
        # nothing moved: the lease is still held, the decode worker reserved nothing, the state is still good
        assert prefill_worker.load().leases == 1
        load = decode_worker.load()
        assert load.kv_pages_used == 0 and load.reservations == 0
        assert list(first.first.token_ids) + decode(decode_worker, "r", prompt, first) == one_rank_tokens(model)[1]
        assert mesh.wait_idle() == {}
    finally:
        mesh.stop()


def test_the_recipes_decode_layout_takes_states_from_a_tensor_parallel_prefill_worker(hf_checkpoints, tmp_path):
    """Decode with data-parallel attention and expert parallelism (each rank its own requests, the experts split
    whole) fed by a two-rank tensor-parallel prefill worker; a data-parallel prefill worker feeding a one-rank
    decode worker and the data-parallel one, its states read where its ranks hold them. Greedy tokens as the
    one-rank engine's (Qwen3-Next, fp32)."""
    model = hf_checkpoints["qwen3_next"]
    want = one_rank_tokens(model)
    dep = ["--data-parallel-size", "2", "--enable-expert-parallel"]
    mesh = start_mesh(str(model), tmp_path, prefill=0, decode=0, worker_args=WORKER_ARGS)
    try:
        tp_prefill = mesh.start_worker("prefill", ["--tensor-parallel-size", "2"])
        dp_prefill = mesh.start_worker("prefill", dep)
        dp_decode = mesh.start_worker("decode", dep)
        one_rank_decode = mesh.start_worker("decode")
        mesh.wait_ready()
        held_on_rank_1 = 0
        for name, p, d in (
            ("tp2->dep2", tp_prefill, dp_decode),
            ("dep2->1", dp_prefill, one_rank_decode),
            ("dep2->dep2", dp_prefill, dp_decode),
        ):
            for i, prompt in enumerate(PROMPTS):
                first = prefill(p, f"{name}-{i}", prompt)
                # a state the data-parallel prefill worker's second rank computed is read from that rank's process
                held_on_rank_1 += bool(ucx_pb2.UcxLeaseDescriptor.FromString(first.transport.payload).peer_addresses)
                got = list(first.first.token_ids) + decode(d, f"{name}-{i}", prompt, first)
                assert got == want[i], f"{name}, prompt {i}"
        assert held_on_rank_1 >= 2  # requests spread over the ranks in both data-parallel prefill runs
        assert dp_decode.load().state_slots_total == 2 * 4  # both ranks' slots
        assert mesh.wait_idle() == {}
    finally:
        mesh.stop()
