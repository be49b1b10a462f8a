"""The one message of the UCX side channel: a puller's notice to the holder (PullNotice, length-prefixed
protobuf in a tagged UCX message)."""

from __future__ import annotations

import struct

NOTICE_TAG = 0x646D_7368_0000_0001  # "dmsh" + 1: where holders receive the pullers' notices
MAX_NOTICE_BYTES = 1 << 12
_LEN = struct.Struct("<I")


def frame(msg):
    """`msg` serialised behind its length, as a host buffer UCX can send."""
    import numpy as np

    body = msg.SerializeToString()
    return np.frombuffer(_LEN.pack(len(body)) + body, dtype=np.uint8)


def unframe(buf, cls):
    (n,) = _LEN.unpack_from(buf, 0)
    msg = cls()
    msg.ParseFromString(bytes(buf[_LEN.size : _LEN.size + n]))
    return msg
