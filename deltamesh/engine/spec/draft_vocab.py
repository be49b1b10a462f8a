"""A reduced draft vocabulary (FR-Spec; SGLang's `--speculative-token-map`): the MTP drafter's logits over only a
set of "hot" token ids, so each draft reads N rows of the LM head instead of all of them (on the 35B-A3B shape
the whole head is 248,320 x 2,048 bf16, about 1 GB per draft; 32k hot rows read an eighth of it).

The drafts stay greedy point masses (spec/accept.py): verification keeps the output exact whatever the drafter
proposes. A token outside the hot set is never drafted, so never accepted from a draft, and the target still emits
it as the token it samples after the accepted run: acceptance can drop, the output cannot change.

`DraftHead` gathers the hot rows once, when the engine is built, into one contiguous [N, hidden] weight in the LM
head's dtype. The LM head is never FP8 here: the loader keeps FP8 values only in the projections
(weights.fp8_weights), an FP8 checkpoint's head is dequantized on load. Under tensor parallelism the LM head is
split by vocabulary rows (engine/parallel.py): each rank keeps the hot rows of its own shard (possibly none) and
proposes its best (logit, id); the ranks' proposals are gathered and the largest logit wins, ties to the lowest
rank, that is the lowest id, as an argmax over the whole hot set in id order gives.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from deltamesh.engine.spec.settings import draft_vocab_count

if TYPE_CHECKING:
    from deltamesh.engine.models import HybridLM

# the ranks' best ids travel beside their logits as float32, exact for integers below 2**24
_LARGEST_EXACT_ID = 2**24


def draft_vocab_ids(setting: str, vocab_size: int) -> torch.Tensor:
    """The hot token ids of a --speculative-draft-vocab setting (spec/settings.check_draft_vocab), sorted, int64
    on the CPU; ValueError saying what is wrong (a count out of range, a missing or unreadable map, ids out of
    the vocabulary, repeated ids, an empty map). A map is read and checked once per process while its file is
    unchanged: the settings' check, the memory budget and the engine's build all ask for it."""
    path, stamp = Path(setting), None
    if draft_vocab_count(setting) is None and path.is_file():
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
    return _checked_ids(setting, vocab_size, stamp).clone()


@functools.lru_cache(maxsize=8)
def _checked_ids(setting: str, vocab_size: int, stamp: tuple[int, int] | None) -> torch.Tensor:
    """draft_vocab_ids of a file as it was at `stamp` (its mtime and size), or of a count (None)."""
    name = "speculative_draft_vocab"
    count = draft_vocab_count(setting)
    if count is not None:
        if not 1 <= count <= vocab_size:
            raise ValueError(f"{name} {count}: a count of token ids must be in [1, {vocab_size}] (the vocabulary)")
        return torch.arange(count, dtype=torch.int64)
    ids = _read_token_map(Path(setting), name)
    if ids.numel() == 0:
        raise ValueError(f"{name} {setting}: the token map is empty")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} {setting}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    unique = torch.unique(ids)  # sorted
    if unique.numel() != ids.numel():
        values, counts = torch.unique(ids, return_counts=True)
        repeated = values[counts > 1][:5].tolist()
        raise ValueError(f"{name} {setting}: token ids appear more than once (e.g. {repeated})")
    return unique


def _read_token_map(path: Path, name: str) -> torch.Tensor:
    """A token map's ids as one int64 tensor: a JSON list of ids (.json), else a torch-saved 1-D tensor (SGLang's
    .pt)."""
    if not path.is_file():
        raise ValueError(f"{name} {str(path)!r}: no such file (give a token map's path, .pt or .json, or a count N)")
    if path.suffix == ".json":
        try:
            loaded = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{name} {path}: not a JSON list of token ids ({e})") from None
        if not isinstance(loaded, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in loaded):
            raise ValueError(f"{name} {path}: a JSON token map must be a list of integer token ids")
        return torch.tensor(loaded, dtype=torch.int64)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several kinds for a file that is not its format
        raise ValueError(f"{name} {path}: not a torch-saved tensor of token ids ({e})") from None
    if not isinstance(loaded, torch.Tensor) or loaded.dim() != 1 or loaded.is_floating_point() or loaded.is_complex():
        what = (
            f"a {loaded.dim()}-D {loaded.dtype} tensor" if isinstance(loaded, torch.Tensor) else type(loaded).__name__
        )
        raise ValueError(f"{name} {path}: a token map must be a 1-D integer tensor of token ids, got {what}")
    return loaded.to(torch.int64)


class DraftHead:
    """The hot rows of this rank's LM head and the full-vocabulary id of each."""

    def __init__(self, model: HybridLM, hot_ids: torch.Tensor):
        """`hot_ids`: sorted unique ids of the full vocabulary (draft_vocab_ids)."""
        head = model.lm_head
        if head.dtype == torch.float8_e4m3fn:
            raise ValueError("speculative_draft_vocab: the LM head is FP8, which the reduced draft head cannot gather")
        if model.cfg.vocab_size >= _LARGEST_EXACT_ID:
            raise ValueError(f"speculative_draft_vocab: a vocabulary of {model.cfg.vocab_size} ids is not supported")
        self.tp = model.tp
        first = self.tp.shard.rank * head.shape[0] if self.tp else 0  # this rank's rows are ids [first, first + rows)
        hot_ids = hot_ids.to(head.device)
        mine = hot_ids[(hot_ids >= first) & (hot_ids < first + head.shape[0])]
        self.ids = mine  # [n] the full-vocabulary id of each row of `weight`
        with torch.no_grad():
            self.weight = head[mine - first].contiguous()  # [n, hidden], a copy: the LM head itself stays whole

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T] int64: for each row of `hidden` [T, hidden], the hot id of the largest logit."""
        if self.ids.numel():
            logits = F.linear(hidden, self.weight).float()
            at = logits.argmax(-1)  # the first largest, as the full head's argmax (max(dim) promises no order)
            best, token = logits.gather(-1, at[:, None]).squeeze(-1), self.ids[at]
        else:  # none of the hot ids is in this rank's shard: it proposes nothing another rank could lose to
            best = torch.full(hidden.shape[:1], -torch.inf, device=hidden.device)
            token = torch.zeros(hidden.shape[0], dtype=torch.int64, device=hidden.device)
        if self.tp is None:
            return token
        proposals = self.tp.all_gather(torch.stack([best, token.float()], dim=-1))  # [ranks, T, 2]
        winner = proposals[..., 0].argmax(0)  # the first largest: the lowest rank holds the lowest ids
        return proposals[..., 1].gather(0, winner[None]).squeeze(0).long()
