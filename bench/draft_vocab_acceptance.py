"""What a reduced draft head costs in acceptance, and what a measured token map gives back (#42), on the CPU with
the default model's trained MTP module (scripts/make_default_mtp.py): the engine's own greedy speculative decoding
(K = 3) of held-out prompts with the full draft head, with the N lowest token ids (`--speculative-draft-vocab N`)
and with the N most frequent ids of the model's training text (`deltamesh token-map`, engine/spec/token_map.py),
for each N of --sizes. The prompts and the measurement are make_default_mtp.py's (48 held-out windows of 32
tokens, 64 new tokens each); the maps are counted on the training split only. The output is the same in every
row (drafts are verified): the rows differ in drafts accepted per verify step only.

    python bench/draft_vocab_acceptance.py --out bench/results/draft_vocab_acceptance.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ints, print_table, write_result
from deltamesh.engine.spec.token_map import count_tokens, frequent_token_map
from deltamesh.engine.tokenizer import Tokenizer
from scripts.default_model_data import build_documents, split_documents, token_stream
from scripts.make_default_mtp import MEASURE_K, held_out_prompts, run_acceptance


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/deltamesh-tiny")
    p.add_argument("--sizes", type=ints, default=[256, 512, 1024, 2048], help="hot-set sizes, comma-separated")
    p.add_argument("--out", default=str(RESULTS / "draft_vocab_acceptance.json"))
    args = p.parse_args()
    torch.manual_seed(0)
    tokenizer = Tokenizer(args.model)
    train_docs, val_docs = split_documents(build_documents())
    prompts = held_out_prompts(token_stream(tokenizer.backend, val_docs))
    train_counts = count_tokens(tokenizer, train_docs)
    held_out_counts = count_tokens(tokenizer, val_docs)

    row, reference = run_acceptance(args.model, prompts)
    rows = [{"head": "full", "size": tokenizer.vocab_size, "held_out_coverage": 1.0, **row, "same_output": True}]
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            built = frequent_token_map(tokenizer, train_counts, size)
            path = Path(tmp) / f"frequent-{size}.pt"
            built.save(path)
            lowest = torch.arange(size)
            for head, setting, ids in (
                ("lowest ids", str(size), lowest),
                ("frequent (training text)", str(path), built.ids),
            ):
                row, outputs = run_acceptance(args.model, prompts, setting)
                coverage = float(held_out_counts[ids].sum()) / float(held_out_counts.sum())
                rows.append(
                    {"head": head, "size": len(ids), "held_out_coverage": round(coverage, 3), **row}
                    | {"same_output": outputs == reference}
                )
                print_table(rows[-1:], ["head", "size", "held_out_coverage", "per_position", "tokens_per_step"])
    print_table(rows, ["head", "size", "held_out_coverage", "per_position", "tokens_per_step", "same_output"])
    write_result(args.out, {"model": args.model, "k": MEASURE_K, "prompts": len(prompts), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
