"""What two engines must agree on to hand a request's state from one to the other: the byte layout of held state
(its version) and the compatibility hash over everything that shapes those bytes (model, dtypes, pool layouts,
page size, parallelism). The engine owns both: a change to the pools' layout bumps the version here."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltamesh.engine.core import EngineCore

# Bump when the byte layout of held state changes.
STATE_LAYOUT_VERSION = "kv:page-major[page,layer,kv,slot,head,dim]/gdn:slot-major[slot,layer,...]/v1"


def compat_hash(core: "EngineCore") -> str:
    cfg = core.config
    blob = json.dumps(
        {
            "model": json.loads(core.model_config.to_json()),
            "dtype": str(core.dtype),
            "state_dtype": cfg.state_dtype,
            "page_size": cfg.page_size,
            "layout": STATE_LAYOUT_VERSION,
            "tensor_parallel": 1,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]
