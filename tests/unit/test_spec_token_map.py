"""`deltamesh token-map` (engine/spec/token_map.py): a token map of the most frequent ids of a text, every special
token included, written as SGLang's .pt or as .json, read back by --speculative-draft-vocab; what it counts in
.jsonl / .json / plain text; bad input exits 2 with the reason."""

import json
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from deltamesh.engine import DEFAULT_MODEL
from deltamesh.engine.spec.draft_vocab import draft_vocab_ids
from deltamesh.engine.spec.token_map import count_tokens, frequent_token_map, texts_of
from deltamesh.engine.tokenizer import Tokenizer
from deltamesh.services.cli import app

pytestmark = pytest.mark.spec
TEXT = ["def add(a, b):\n    return a + b\n", "The function adds two numbers and returns their sum.", "x = add(1, 2)"]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEFAULT_MODEL)


def special_ids(tokenizer) -> set[int]:
    return set(tokenizer.backend.get_added_tokens_decoder())


def test_counts_are_the_tokenizers_own(tokenizer):
    counts = count_tokens(tokenizer, TEXT)
    expected = Counter(i for text in TEXT for i in tokenizer.encode(text, add_special_tokens=False))
    assert {i: int(counts[i]) for i in counts.nonzero().flatten().tolist()} == dict(expected)


def test_the_map_holds_every_special_token_then_the_most_frequent(tokenizer):
    counts = count_tokens(tokenizer, TEXT)
    special = special_ids(tokenizer)
    seen = Counter({i: int(counts[i]) for i in counts.nonzero().flatten().tolist() if i not in special})
    extra = 5
    built = frequent_token_map(tokenizer, counts, len(special) + extra)
    ids = set(built.ids.tolist())
    assert built.ids.tolist() == sorted(ids) and special <= ids and len(ids) == len(special) + extra
    # the most frequent non-special ids, ties to the lower id
    expected = sorted(seen, key=lambda i: (-seen[i], i))[:extra]
    assert ids - special == set(expected)
    assert built.counted == sum(int(c) for c in counts) and built.distinct == int((counts > 0).sum())
    covered = sum(int(counts[i]) for i in ids)
    assert built.coverage == pytest.approx(covered / built.counted)


def test_a_text_with_fewer_distinct_tokens_gives_a_smaller_map(tokenizer):
    counts = count_tokens(tokenizer, TEXT)
    built = frequent_token_map(tokenizer, counts, tokenizer.vocab_size)
    assert len(built.ids) == len(special_ids(tokenizer) | set(counts.nonzero().flatten().tolist()))
    assert built.coverage == 1.0


def test_sizes_out_of_range_are_refused(tokenizer):
    counts = count_tokens(tokenizer, TEXT)
    for size in (0, tokenizer.vocab_size + 1):
        with pytest.raises(ValueError, match="size must be in"):
            frequent_token_map(tokenizer, counts, size)
    with pytest.raises(ValueError, match="added tokens, more than a map of 1"):
        frequent_token_map(tokenizer, counts, 1)


@pytest.mark.parametrize("suffix", [".pt", ".json"])
def test_a_saved_map_is_what_the_draft_head_reads(tokenizer, tmp_path, suffix):
    built = frequent_token_map(tokenizer, count_tokens(tokenizer, TEXT), 100)
    path = tmp_path / f"map{suffix}"
    built.save(path)
    assert torch.equal(draft_vocab_ids(str(path), tokenizer.vocab_size), built.ids)


def test_every_string_of_json_and_every_paragraph_of_text_is_counted(tmp_path):
    records = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "n": 3},
        {"prompt": "p", "completion": "c"},
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (tmp_path / "b.json").write_text(json.dumps({"data": records}))
    (tmp_path / "c.txt").write_text("one\ntwo\n\nthree\n")
    strings = ["user", "hi", "assistant", "hello", "p", "c"]  # values, never keys
    assert list(texts_of(tmp_path / "a.jsonl")) == strings
    assert list(texts_of(tmp_path / "b.json")) == strings
    assert list(texts_of(tmp_path / "c.txt")) == ["one\ntwo\n\n", "three\n"]


def token_map_command(*args: str):
    return CliRunner().invoke(app, ["token-map", *args])


def test_the_command_writes_a_map_and_refuses_bad_input_with_the_reason(tokenizer, tmp_path):
    corpus = tmp_path / "traffic.jsonl"
    corpus.write_text("\n".join(json.dumps({"prompt": t}) for t in TEXT) + "\n")
    out = tmp_path / "map.pt"
    done = token_map_command(str(corpus), "--model", str(DEFAULT_MODEL), "--size", "40", "--out", str(out))
    assert done.exit_code == 0 and f"wrote {out}: 40 token ids" in done.stdout, done.output
    expected = frequent_token_map(tokenizer, count_tokens(tokenizer, TEXT), 40).ids
    assert torch.equal(draft_vocab_ids(str(out), tokenizer.vocab_size), expected)
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    (tmp_path / "empty.txt").write_text("")
    model, size = ["--model", str(DEFAULT_MODEL)], ["--size", "40"]
    for args, reason in [
        ([str(tmp_path / "nowhere.txt"), *model, *size], "no such file"),
        ([str(tmp_path / "broken.jsonl"), *model, *size], "Expecting property name"),
        ([str(tmp_path / "empty.txt"), *model, *size], "no text to count"),
        ([str(corpus), *model, "--size", "0"], "size must be in"),
        ([str(corpus), "--model", str(tmp_path), *size], "no tokenizer.json"),
    ]:
        done = token_map_command(*args, "--out", str(tmp_path / "x.pt"))
        assert done.exit_code == 2 and reason in done.stderr, (args, done.output)
        assert not (tmp_path / "x.pt").exists()
