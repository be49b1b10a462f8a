"""The gRPC floor per streamed token on loopback: what it costs a process to receive one token of a generation
stream (and its peer to send it), with nothing of the router behind it, in the two shapes a worker could send a
decode step's tokens to the router:

- per-request: S concurrent server streams, the product's own `DecodeWorker.Decode` (a `TokenDelta` a message, one
  token each): today's worker -> router shape, one message per token;
- multiplexed: one bidirectional stream for all S requests: the receiver sends the S `DecodeRequest`s on it, and at
  every step the sender sends ONE message holding each request's token (`StepTokens`: repeated `GenerateResponse`,
  a request id and its `TokenDelta`): the candidate shape, one message per step;
- multiplexed-demux: the same stream, each token then handed to its request's own task through a queue, as a router
  would have to (its client-facing stream is still one per request): what the candidate shape would cost the
  router's receiving side, not only the transport.

Sender and receiver are two processes (this script run as `serve` and as `receive`), each on uvloop with grpc.aio
and the services' channel and server options, as the router and the workers run. The sender makes a step every
1 / rate seconds (rate 0: as fast as it can, which measures the throughput ceiling); the receiver counts the tokens
and reads both processes' CPU (user + system, from /proc) over a window after a warm-up.

    python bench/grpc_floor.py --streams 16,64 --step-rates 50,0 --seconds 5

`StepTokens` is built here at run time from the product's generated descriptors (a message of this benchmark
only: there is no such message in protos/)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, busy_warning, print_table, write_result
from bench.sim_load import process_cpu_seconds
from bench.sim_workers import Steps
from deltamesh.services.common.server import CHANNEL_OPTIONS, SERVER_OPTIONS
from deltamesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2

SHAPES = ("per-request", "multiplexed", "multiplexed-demux")
STEPS_METHOD = "/deltamesh.bench.Floor/Steps"
PROMPT = [1] * 32
READY = "FLOOR_READY"


def step_tokens_class():
    """StepTokens { repeated deltamesh.v1.GenerateResponse entries = 1; }, made from the generated router
    descriptors so that it parses in the same (C) protobuf runtime as the product's messages."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    name = "deltamesh.bench.StepTokens"
    pool = descriptor_pool.Default()
    try:
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto(name="bench/grpc_floor.proto", package="deltamesh.bench", syntax="proto3")
    file.dependency.append(router_pb2.DESCRIPTOR.name)
    message = file.message_type.add(name="StepTokens")
    message.field.add(
        name="entries",
        number=1,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
        type_name=".deltamesh.v1.GenerateResponse",
    )
    pool.AddSerializedFile(file.SerializeToString())
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def delta(prompt_len: int, i: int) -> common_pb2.TokenDelta:
    """The i-th token of a request, as a decode worker sends it (bench/sim_workers.FakeDecode's message)."""
    token = (prompt_len + i) % 1000
    return common_pb2.TokenDelta(
        token_ids=[token], text=f" t{token}", usage=common_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=i + 1)
    )


def pacer(step_rate: float):
    """An awaitable per step: the engine-like shared step every 1 / rate s, or (rate 0) just a turn of the loop."""
    if step_rate > 0:
        return Steps(1.0 / step_rate).next
    return lambda: asyncio.sleep(0)


class PerRequestSender(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, step_rate: float):
        self.step = pacer(step_rate)

    async def Decode(self, request, context):
        n, i = len(request.prompt_token_ids), 0
        while True:  # until the receiver cancels
            await self.step()
            yield delta(n, i)
            i += 1


def multiplexed_handler(step_rate: float) -> grpc.GenericRpcHandler:
    step, step_tokens = pacer(step_rate), step_tokens_class()

    async def steps(requests, context):
        live: dict[str, list[int]] = {}  # request id -> [prompt length, tokens sent]

        async def admit() -> None:
            async for request in requests:
                live[request.request_id] = [len(request.prompt_token_ids), 0]

        admitting = asyncio.create_task(admit())
        try:
            while True:
                await step()
                if not live:
                    continue
                entries = []
                for request_id, state in live.items():
                    entries.append(router_pb2.GenerateResponse(request_id=request_id, delta=delta(state[0], state[1])))
                    state[1] += 1
                yield step_tokens(entries=entries)
        finally:
            admitting.cancel()

    return grpc.method_handlers_generic_handler(
        "deltamesh.bench.Floor",
        {
            "Steps": grpc.stream_stream_rpc_method_handler(
                steps,
                request_deserializer=decode_pb2.DecodeRequest.FromString,
                response_serializer=step_tokens.SerializeToString,
            )
        },
    )


async def serve(args) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    if args.shape == "per-request":
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(PerRequestSender(args.step_rate), server)
    else:
        server.add_generic_rpc_handlers((multiplexed_handler(args.step_rate),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(READY, port, flush=True)
    await server.wait_for_termination()


def request(i: int) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        request_id=f"floor-{i}", prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=1 << 30)
    )


async def receive(args) -> None:
    """Open the streams, let them settle for --warmup s, then count tokens and both processes' CPU for --seconds s."""
    channel = grpc.aio.insecure_channel(args.target, options=CHANNEL_OPTIONS)
    received = [0, 0]  # tokens, messages
    tasks: list[asyncio.Task] = []
    if args.shape == "per-request":
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)

        async def one(i: int) -> None:
            async for message in stub.Decode(request(i)):
                received[0] += len(message.token_ids)
                received[1] += 1

        tasks = [asyncio.create_task(one(i)) for i in range(args.streams)]
    else:
        step_tokens = step_tokens_class()
        call = channel.stream_stream(
            STEPS_METHOD,
            request_serializer=decode_pb2.DecodeRequest.SerializeToString,
            response_deserializer=step_tokens.FromString,
        )()
        for i in range(args.streams):
            await call.write(request(i))
        queues = {f"floor-{i}": asyncio.Queue() for i in range(args.streams)}
        demux = args.shape == "multiplexed-demux"

        async def read() -> None:
            async for message in call:
                received[1] += 1
                for entry in message.entries:
                    if demux:
                        queues[entry.request_id].put_nowait(entry.delta)
                    else:
                        received[0] += len(entry.delta.token_ids)

        async def consume(queue: asyncio.Queue) -> None:  # a request's own task, as the router's stream would be
            while True:
                # awaited first: `received[0] += len(await ...)` would read the count before the await and lose
                # the other tasks' additions made meanwhile
                token = await queue.get()
                received[0] += len(token.token_ids)

        tasks = [asyncio.create_task(read())] + [asyncio.create_task(consume(q)) for q in queues.values() if demux]
    await asyncio.sleep(args.warmup)
    mine, theirs = [os.getpid()], [args.server_pid]
    tokens0, messages0 = received
    t0, cpu0, sender0 = time.monotonic(), process_cpu_seconds(mine), process_cpu_seconds(theirs)
    await asyncio.sleep(args.seconds)
    tokens, messages = received[0] - tokens0, received[1] - messages0
    seconds = time.monotonic() - t0
    cpu, sender = process_cpu_seconds(mine) - cpu0, process_cpu_seconds(theirs) - sender0
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
    for task in tasks:
        task.cancel()
    await channel.close()
    row = {
        "tokens": tokens,
        "messages": messages,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "receiver_us_per_token": round(1e6 * cpu / max(tokens, 1), 1),
        "sender_us_per_token": round(1e6 * sender / max(tokens, 1), 1),
        "receiver_cores": round(cpu / seconds, 3),
        "sender_cores": round(sender / seconds, 3),
        # /proc counts CPU in clock ticks (10 ms): a row with little CPU in its window is coarse (paced, few streams)
        "receiver_cpu_s": round(cpu, 3),
        "sender_cpu_s": round(sender, 3),
        "errors": [repr(t.exception())[:200] for t in failed],
    }
    print(json.dumps(row), flush=True)


def measure(shape: str, streams: int, step_rate: float, seconds: float, warmup: float) -> dict:
    """One row: a sender process and a receiver process, both started fresh (their CPU is theirs alone)."""
    script = str(Path(__file__).resolve())
    sender = subprocess.Popen(
        [sys.executable, script, "serve", "--shape", shape, "--step-rate", str(step_rate)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = sender.stdout.readline().split()
        if not line or line[0] != READY:
            raise RuntimeError(f"the sender did not start (exit {sender.poll()})")
        receiver = subprocess.run(
            [sys.executable, script, "receive", "--shape", shape, "--streams", str(streams)]
            + ["--target", f"127.0.0.1:{line[1]}", "--server-pid", str(sender.pid)]
            + ["--seconds", str(seconds), "--warmup", str(warmup)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=seconds + warmup + 120,
        )
        if receiver.returncode != 0:
            raise RuntimeError(f"the receiver failed:\n{receiver.stderr[-2000:]}")
        row = json.loads(receiver.stdout.strip().splitlines()[-1])
    finally:
        sender.kill()
        sender.wait()
    return {"shape": shape, "streams": streams, "step_rate": step_rate, **row}


COLUMNS = [
    "shape",
    "streams",
    "step_rate",
    "tokens",
    "messages",
    "tokens_per_s",
    "receiver_us_per_token",
    "sender_us_per_token",
    "receiver_cores",
    "sender_cores",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="(internal) the sending process")
    s.add_argument("--shape", choices=SHAPES, required=True)
    s.add_argument("--step-rate", type=float, required=True)
    r = sub.add_parser("receive", help="(internal) the receiving process")
    r.add_argument("--shape", choices=SHAPES, required=True)
    r.add_argument("--streams", type=int, required=True)
    r.add_argument("--target", required=True)
    r.add_argument("--server-pid", type=int, required=True)
    r.add_argument("--seconds", type=float, required=True)
    r.add_argument("--warmup", type=float, required=True)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--streams", default="16,64", help="concurrent requests S, comma-separated")
    p.add_argument("--step-rates", default="50,0", help="steps/s of the sender (0: as fast as it can)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured window of each row")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before the window (connections, first calls)")
    p.add_argument("--out")
    args = p.parse_args()
    if args.command in ("serve", "receive"):
        import uvloop

        uvloop.run((serve if args.command == "serve" else receive)(args))
        return
    rows, out = [], args.out or ROOT / "bench" / "results" / "grpc_floor.json"
    for streams in (int(x) for x in args.streams.split(",")):
        for rate in (float(x) for x in args.step_rates.split(",")):
            for shape in args.shapes.split(","):
                rows.append(measure(shape, streams, rate, args.seconds, args.warmup))
                print_table(rows[-1:], COLUMNS)
                # after each row: a run cut short by its time bound (scripts/gpu_stage.sh) keeps what it measured
                warning = busy_warning("CPU per token is stretched on a loaded machine; tokens/s at rate 0 too")
                write_result(out, {"rows": rows, "warning": warning})
    print()
    print_table(rows, COLUMNS)
    if warning:
        print(warning)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
