"""Multi-turn chat serving with and without the prefix cache. `--users` conversations run at once, each of
`--turns` turns; a turn sends the whole conversation so far (a `--system-len`-token system prompt shared by all
users, then every earlier message and reply) plus a new `--message-len`-token message, and gets a
`--reply-len`-token reply; each message opens with the chat template's message token where the model has one.
`--stagger-ms` spreads the users' first turns. The script starts `deltamesh serve` once per setting (prefix cache off, on; colocated
or 1P+1D), drives it through the gRPC SDK with token-id prompts and prints, per turn, the median and p90 TTFT
and the prompt tokens the workers computed against those they took from the cache, next to the ideal (every
token a worker has computed before, for this conversation or the shared system prompt).

    python bench/multi_turn.py                                      # CPU, the default model
    python bench/multi_turn.py --device cuda --dtype bfloat16 --load-format dummy \\
        --model bench/configs/qwen3.5-9b --system-len 2048 --message-len 200 --reply-len 256 --users 16
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ROOT, free_port, print_table, stop_group, with_tokenizer, write_result
from bench.disagg_sweep import wait_ready
from deltamesh.engine import DEFAULT_MODEL
from deltamesh.engine.prefix_cache import TURN_START
from deltamesh.engine.tokenizer import Tokenizer


def serve(args, cache: bool, log: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """`deltamesh serve` with or without the prefix cache: (process, gRPC address, worker metrics URLs)."""
    grpc_port, http_port = free_port(), free_port()
    history = args.system_len + args.turns * (args.message_len + args.reply_len) + 16
    cmd = [
        sys.executable,
        "-m",
        "deltamesh.services.cli",
        "serve",
        "--model",
        args.model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--load-format",
        args.load_format,
        "--grpc-port",
        str(grpc_port),
        "--control-port",
        str(free_port()),
        "--http-port",
        str(http_port),
        "--max-model-len",
        str(history),
        "--max-num-seqs",
        str(max(args.users, 4)),
        "--log-level",
        "warning",
        "--prefix-cache" if cache else "--no-prefix-cache",
        *args.serve_flag,
    ]
    cmd += ["--colocated", "--decode-workers", "1"] if args.setup == "colocated" else []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(proc, f"http://127.0.0.1:{http_port}/ready", log)
    urls = re.findall(r"(?:prefill|decode|colocated) (http://\S+/metrics)", log.read_text())
    return proc, f"127.0.0.1:{grpc_port}", urls


def worker_counters(urls: list[str]) -> dict[str, float]:
    """Prompt tokens the workers computed and took from a prefix cache (their own, or a decode worker's through
    the reverse pull), summed over workers."""
    total = {"computed": 0.0, "cached": 0.0}
    names = {
        "deltamesh_engine_prompt_tokens_total": "computed",
        "deltamesh_engine_prefix_cache_hit_tokens_total": "cached",
        "deltamesh_engine_reverse_pull_tokens_total": "cached",
    }
    for url in urls:
        for line in httpx.get(url, timeout=5).text.splitlines():
            name, _, value = line.partition("{")
            if name in names:
                total[names[name]] += float(value.rsplit(" ", 1)[1])
    return total


def message(rng: np.random.Generator, args, n: int) -> list[int]:
    """n random tokens, opened by the chat template's message token when the model has one (so the workers
    see the message boundaries they checkpoint, as in a chat prompt)."""
    opener = [args.opener] if args.opener is not None else []
    return opener + rng.integers(10, args.vocab, n - len(opener)).tolist()


async def conversation(client, user: int, args, system: list[int], ttft: list[list[float]], barrier) -> None:
    rng = np.random.default_rng(1000 + user)
    history = list(system)
    await asyncio.sleep(user * args.stagger_ms / 1e3)
    for turn in range(args.turns):
        history += message(rng, args, args.message_len)
        start, first, reply = time.perf_counter(), None, []
        async with client.stream(history, max_tokens=args.reply_len, temperature=0, ignore_eos=True) as stream:
            async for delta in stream:
                if delta.token_ids and first is None:
                    first = time.perf_counter() - start
                reply += delta.token_ids
        ttft[turn].append(first * 1e3)
        history += reply
        await barrier(turn)


async def drive(address: str, args, urls: list[str]) -> list[dict]:
    """Every user's conversation; the users move from turn to turn together, so each turn's counters are its own."""
    from deltamesh.client import AsyncClient

    system = message(np.random.default_rng(0), args, args.system_len)
    ttft: list[list[float]] = [[] for _ in range(args.turns)]
    counters = [worker_counters(urls)]
    arrived = [0] * args.turns
    turn_done = [asyncio.Event() for _ in range(args.turns)]

    async def barrier(turn: int) -> None:
        arrived[turn] += 1
        if arrived[turn] == args.users:
            counters.append(worker_counters(urls))
            turn_done[turn].set()
        await turn_done[turn].wait()

    async with AsyncClient(address, retries=0) as client:
        started = time.perf_counter()
        await asyncio.gather(*(conversation(client, u, args, system, ttft, barrier) for u in range(args.users)))
        seconds = time.perf_counter() - started
    rows = []
    for turn in range(args.turns):
        before, after = counters[turn], counters[turn + 1]
        prompt = args.system_len + (turn + 1) * args.message_len + turn * args.reply_len
        # ideal: the system prompt for all but the first user's first turn; after that the whole conversation
        # before this turn's message but the last reply token (sampled, never fed back before this turn)
        ideal = (args.users - 1) * args.system_len if turn == 0 else args.users * (prompt - args.message_len - 1)
        cached = after["cached"] - before["cached"]
        rows.append(
            {
                "turn": turn + 1,
                "prompt_tokens": prompt,
                "ttft_median_ms": float(np.median(ttft[turn])),
                "ttft_p90_ms": float(np.percentile(ttft[turn], 90)),
                "computed_tokens": after["computed"] - before["computed"],
                "cached_tokens": cached,
                "of_ideal": cached / ideal if ideal else None,
            }
        )
    tokens = sum(r["prompt_tokens"] for r in rows) * args.users + args.turns * args.users * args.reply_len
    for r in rows:
        r["total_tok_s"] = tokens / seconds
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--setup", choices=["colocated", "disagg"], default="colocated")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--message-len", type=int, default=32)
    p.add_argument("--reply-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=None, help="token ids are drawn below this (default: the model's)")
    p.add_argument("--stagger-ms", type=float, default=0.0, help="user u starts its first turn u x this late")
    p.add_argument("--serve-flag", action="append", default=[], help="extra flag for `deltamesh serve` (repeatable)")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--out", default=str(RESULTS / "multi_turn.json"))
    args = p.parse_args()
    if args.vocab is None:
        from deltamesh.engine.config import ModelConfig

        args.vocab = ModelConfig.from_dir(args.model).vocab_size
    if not (Path(args.model) / "tokenizer.json").is_file():  # a shape from bench/configs: config.json alone
        args.model = str(with_tokenizer(Path(args.model), Path(args.log_dir)))
    args.opener = Tokenizer(args.model).token_id(TURN_START)
    rows = []
    for cache in (False, True):
        proc, address, urls = serve(
            args, cache, Path(args.log_dir) / f"multi-turn-cache-{'on' if cache else 'off'}.log"
        )
        try:
            for r in asyncio.run(drive(address, args, urls)):
                rows.append({"setup": args.setup, "prefix_cache": cache, **r})
        finally:
            stop_group(proc)
    print_table(
        rows,
        [
            "setup",
            "prefix_cache",
            "turn",
            "prompt_tokens",
            "ttft_median_ms",
            "ttft_p90_ms",
            "computed_tokens",
            "cached_tokens",
            "of_ideal",
            "total_tok_s",
        ],
    )
    write_result(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
