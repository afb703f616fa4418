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

CATEGORIES = ("Functional", "Tensor", "Torch", "NPU", "Aten", "Distributed", "Custom")
# Custom: an operator of a custom `torch.library` namespace (a `torch.library.custom_op`, a `Library.define`, a C++
# extension), its api `<namespace>.<op>`: the only category whose api holds a dot (`Custom.mylib.fused_gelu.0`).
CUSTOM = "Custom"
# Strict names: ASCII only, anchored with \Z (`$` would accept a trailing newline), digits spelled [0-9] (`\d`
# would accept any Unicode digit). `.match` on these is a full match.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,127}"
API_NAME = re.compile(r"^" + _IDENT + r"\Z", re.ASCII)
# group(1): the category, group(2): the api, group(3): the counter. The api is one identifier, or for Custom (the
# lookbehind: no other category ends in "Custom") exactly two joined by one dot.
CALL_NAME = re.compile(r"^(" + "|".join(CATEGORIES) + r")\.((?<=^Custom\.)" + _IDENT + r"\." + _IDENT
                       + r"|(?<!^Custom\.)" + _IDENT + r")\.([0-9]{1,9})\Z", re.ASCII)
RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z", re.ASCII)


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
    max_batch_records: int = 4096                  # records in one Batch frame (protos/framing.py)
    # the gRPC transport (gpu_server/intake/grpc_service.py)
    max_streams: int = 1024                        # agent streams served at once; more are refused with a reason
    # A record half received (gpu_server/intake/assembler.py) is cut, its stream closed and its bytes released,
    # when its next frame takes longer than record_timeout_s, when after that long it arrives slower than
    # min_record_rate on average (time its stream waited for the server's memory budget is not counted), or when it
    # has been half received for record_max_s, whatever its size.
    record_timeout_s: float = 60.0
    min_record_rate: float = 1.0 * MiB             # bytes per second
    record_max_s: float = 600.0
    max_connection_bytes: int = 0                  # what one connection's streams may hold before the workers take
    #                                                it (frames, half-received records); 0: max_record_bytes
    max_run_ranks: int = 4096                      # distinct (run id, rank) pairs one server accepts records of

    @property
    def connection_bytes(self) -> int:
        return self.max_connection_bytes or self.max_record_bytes

    def replace(self, **changes: Any) -> "Limits":
        return dataclasses.replace(self, **changes)


DEFAULT_LIMITS = Limits()


def log_text(value: object, limit: int = 80) -> str:
    """A wire string made safe for one log line: at most `limit` characters, anything that is not printable ASCII
    (newlines, carriage returns, escape sequences, Unicode look-alikes) escaped, so no field can forge a log line."""
    s = value if isinstance(value, str) else str(value)
    cut = len(s) > limit
    out = ascii(s[:limit])[1:-1]
    return out + "..." if cut else out


def valid_call_name(name: str) -> re.Match[str] | None:
    """`Category.api.n` with a known category, an identifier-like api (for Custom `namespace.op`) and a decimal
    counter; else None. group(1) is the category, group(2) the api, group(3) the counter."""
    if not isinstance(name, str) or len(name) > DEFAULT_LIMITS.max_name_len:
        return None
    return CALL_NAME.match(name)


def _api_parts(name: str) -> int:
    """How many dot-separated parts make `Category.api` ("Custom.mylib.op": three; every other category: two)."""
    return 3 if name.startswith("Custom.") else 2


def call_api(name: str) -> str:
    """`Category.api` of a call or report-row name: "Functional.linear.0.forward.output.1" -> "Functional.linear",
    "Custom.mylib.fused_gelu.0" -> "Custom.mylib.fused_gelu"."""
    return ".".join(name.split(".")[:_api_parts(name)])
