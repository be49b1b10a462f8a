"""What two engines must agree on to hand a request's state from one to the other: the byte layout of held state
(its version), the compatibility hash over everything that shapes those bytes (model, dtypes, pool layouts, page
size), and whether the sender's tensor-parallel layout can be mapped onto the receiver's. The engine owns all
three: a change to the pools' layout bumps the version here.

State travels in the layout of a one-rank engine whatever the ranks of either side (engine/tp_handoff.py), so
the ranks are not in the hash: any two layouts that each hold the model map onto each other. A layout that
cannot hold the model (a rank count that does not divide its heads) is refused by `check_layouts`.
"""

from __future__ import annotations

import hashlib
import json

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.parallel import ParallelConfigError, shard_config

# Bump when the byte layout of held state changes.
STATE_LAYOUT_VERSION = "kv:page-major[page,layer,kv,slot,head,dim]/gdn:slot-major[slot,layer,...]/one-rank/v2"


class LayoutMismatch(ValueError):
    """A sender's state layout that cannot be mapped onto this engine's."""


def compat_hash(cfg: EngineConfig, model: ModelConfig) -> str:
    blob = json.dumps(
        {
            "model": json.loads(model.to_json()),
            "dtype": str(cfg.torch_dtype()),
            "state_dtype": cfg.state_dtype,
            "page_size": cfg.page_size,
            "layout": STATE_LAYOUT_VERSION,
            # speculative decoding keeps the MTP module's KV in the pages after the model's layers: a prefill and a
            # decode worker must both draft (with any number of tokens) or neither
            "mtp_kv_layers": model.mtp_layers if cfg.speculative_tokens else 0,
            # random weights are the seed's: workers with other seeds hold other models
            "dummy_seed": cfg.seed if cfg.load_format == "dummy" else None,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def check_layouts(model: ModelConfig, sender_ranks: int, receiver_ranks: int) -> None:
    """Raise LayoutMismatch unless state computed on `sender_ranks` tensor-parallel ranks can be split onto
    `receiver_ranks`: both must be layouts that hold this model (its heads divide among the ranks)."""
    for side, ranks in (("sender", sender_ranks), ("receiver", receiver_ranks)):
        if ranks < 1:
            raise LayoutMismatch(f"the {side}'s tensor-parallel size {ranks} is not a layout")
        try:
            shard_config(model, ranks)
        except ParallelConfigError as e:
            raise LayoutMismatch(f"the {side}'s layout does not fit this model: {e}") from None
