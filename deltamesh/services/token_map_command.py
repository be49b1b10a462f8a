"""`deltamesh token-map`: a measured token map for the reduced draft head (engine/spec/token_map.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def token_map(
    files: Annotated[
        list[Path],
        typer.Argument(
            metavar="FILES",
            help="Text like the served traffic: .jsonl / .json (every string value: prompts, outputs, messages) "
            "or plain text files",
        ),
    ],
    model: Annotated[str, typer.Option(help="The model's directory (its tokenizer.json)")],
    size: Annotated[int, typer.Option(help="Token ids in the map (e.g. 32768 of Qwen3.5's 248,320)")],
    out: Annotated[Path, typer.Option(help="The map: .pt (SGLang's format, a torch-saved tensor) or .json")],
) -> None:
    """Write the `size` most frequent token ids of FILES (and every special token) as a token map for
    `--speculative-draft-vocab FILE`: MTP then drafts over those rows of the LM head only. The output stays exact
    (drafts are verified); acceptance depends on how well the text matches the traffic."""
    from deltamesh.engine.spec.token_map import count_tokens, frequent_token_map, texts_of
    from deltamesh.engine.tokenizer import Tokenizer

    def fail(message: str) -> typer.Exit:
        print(f"deltamesh token-map: {message}", file=sys.stderr)
        return typer.Exit(2)

    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise fail(f"no such file: {', '.join(missing)}")
    try:
        tokenizer = Tokenizer(model)
    except (FileNotFoundError, ValueError) as e:
        raise fail(str(e)) from None
    try:
        counts = count_tokens(tokenizer, (text for f in files for text in texts_of(f)))
        built = frequent_token_map(tokenizer, counts, size)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise fail(str(e)) from None
    if built.counted == 0:
        raise fail("the files hold no text to count")
    built.save(out)
    print(
        f"wrote {out}: {len(built.ids):,} token ids of {tokenizer.vocab_size:,} "
        f"({built.distinct:,} distinct in {built.counted:,} tokens counted; the map covers {built.coverage:.1%} of them)"
    )
