"""Explicit limits on what the wire accepts. Both sides use the same defaults; the server's are configurable.

Every decode checks a record against these before it allocates anything, so a hostile or corrupt record costs
at most the bytes already received.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

MiB = 1 << 20
GiB = 1 << 30

# The tensor payload travels in chunks of this size (reference/limits.md: 1-4 MiB chunks are the fast path).
CHUNK_BYTES = 4 * MiB

CATEGORIES = ("Functional", "Tensor", "Torch", "NPU", "Aten", "Distributed")
API_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
CALL_NAME = re.compile(r"^(" + "|".join(CATEGORIES) + r")\.([A-Za-z_][A-Za-z0-9_]{0,127})\.(\d{1,9})$")
RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class Limits:
    max_frame_bytes: int = CHUNK_BYTES + 16 * MiB  # one gRPC message: the record header plus one chunk
    max_record_bytes: int = 64 * GiB               # the whole tensor payload of one record
    max_tensors: int = 65536                       # tensors in one record
    max_dims: int = 16
    max_numel: int = 1 << 36                       # elements in one tensor
    max_name_len: int = 256
    max_string_len: int = 4096                     # any string value (dtype names, keys, opaque type names)
    max_depth: int = 32                            # nesting of tuples/lists/dicts
    max_values: int = 1_000_000                    # Values in one record
    max_pending_records: int = 1 << 20             # records being assembled per stream

    def replace(self, **changes: Any) -> "Limits":
        return dataclasses.replace(self, **changes)


DEFAULT_LIMITS = Limits()


def valid_call_name(name: str) -> re.Match[str] | None:
    """`Category.api.n` with a known category, an identifier-like api and a decimal counter; else None."""
    if not isinstance(name, str) or len(name) > DEFAULT_LIMITS.max_name_len:
        return None
    return CALL_NAME.match(name)
