"""A Record's protobuf bytes, written directly by the agent (docs/design.md §5, "Records written as bytes").

The agent builds no protobuf message per record. Each message protobuf's Python library (upb) makes lives in an
allocation arena of its own, and so does the map of each message whose unset fields were read; upb calls the C
allocator's `malloc_trim(0)` every 10,000 arena blocks it frees. A record took 8 to 17 of them, so the agent made
upb trim the heap every 600 to 1,200 records, and a trim hands every free page of the process back to the kernel:
the training's own, freed between its steps and about to be reused. Its next tensors then fault in new pages, as
many as it had freed.

So the agent writes the bytes itself, in the canonical form protobuf writes them (fields in number order, proto3
defaults left out, a set sub-message or oneof member always written, repeated numbers packed): the server parses
them with protobuf as before, and tests/test_record_bytes.py checks that protobuf writes back exactly these bytes.

`RecordEncoder` writes a record's values (`Value`, `Sequence`, `Mapping`) and keeps its table of `TensorMeta`
(`metas`: each an entry of Record.tensors, `tensor_entry`);
the field writers below write the rest of the Record (npu_agent/records.py).
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from protos.codec import _LAYOUT_NAMES, _MEMORY_FORMAT_NAMES, Opaque, dtype_name

TensorHook = Callable[[torch.Tensor], dict[str, Any]]   # TensorMeta overrides for one tensor

_U64 = (1 << 64) - 1
_VARINT1 = [bytes((i,)) for i in range(0x80)]   # the one-byte varints


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative integer."""
    if 0 <= n < 0x80:
        return _VARINT1[n]
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# The key of each field number below 32 (all this schema's), by wire type: a list lookup, not a call.
_VARINT_KEY = [varint(f << 3) for f in range(32)]
_FIXED64_KEY = [varint(f << 3 | 1) for f in range(32)]
_LEN_KEY = [varint(f << 3 | 2) for f in range(32)]


def message(field: int, body: bytes) -> bytes:
    """A sub-message that is set (written even when empty)."""
    return b"".join((_LEN_KEY[field], varint(len(body)), body))


def string(field: int, s: str) -> bytes:
    """A proto3 string field: nothing when empty."""
    if not s:
        return b""
    e = s.encode()
    return b"".join((_LEN_KEY[field], varint(len(e)), e))


_SEEN: dict[tuple[int, str], bytes] = {}


def string_seen(field: int, s: str) -> bytes:
    """`string(field, s)` for the text that repeats from record to record (run id, module path, source line),
    remembered (up to 4096 of them, then forgotten all at once)."""
    b = _SEEN.get((field, s))
    if b is None:
        if len(_SEEN) >= 4096:
            _SEEN.clear()
        b = _SEEN[(field, s)] = string(field, s)
    return b


def raw(field: int, b: bytes) -> bytes:
    """A proto3 bytes field: nothing when empty."""
    return b"".join((_LEN_KEY[field], varint(len(b)), b)) if b else b""


def uint(field: int, n: int) -> bytes:
    """A proto3 uint32/uint64/enum field: nothing when 0 (a negative number, which none of them holds, as its 64-bit
    two's complement, as protobuf writes an int64, rather than a varint that never ends)."""
    return b"".join((_VARINT_KEY[field], varint(n & _U64))) if n else b""


def boolean(field: int, b: bool) -> bytes:
    return _VARINT_KEY[field] + b"\x01" if b else b""


def sint32(field: int, n: int) -> bytes:
    """A proto3 sint32 field (zigzag): nothing when 0."""
    return b"".join((_VARINT_KEY[field], varint((n << 1) ^ (n >> 31)))) if n else b""


def packed(field: int, numbers: Iterable[int]) -> bytes:
    """A repeated varint field (int64, uint32), packed as proto3 packs it: nothing when empty."""
    body = b"".join([varint(n & _U64) for n in numbers])
    return b"".join((_LEN_KEY[field], varint(len(body)), body)) if body else b""


def _double(field: int, x: float) -> bytes:
    """A proto3 double field: nothing when +0.0 (protobuf writes -0.0)."""
    b = struct.pack("<d", x)
    return b"" if b == _ZERO else _FIXED64_KEY[field] + b


_ZERO = struct.pack("<d", 0.0)


_META: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}


def tensor_entry(dtype: str, shape: Sequence[int], stride: Sequence[int], offset: int, nbytes: int,
                 requires_grad: bool, device: str) -> bytes:
    """A TensorMeta as an entry of Record.tensors (field 2). All but the offset is remembered by its fields (up to
    4096 layouts, then forgotten all at once): a training's tensors repeat their shapes."""
    k = (dtype, tuple(shape), tuple(stride), nbytes, requires_grad, device)
    parts = _META.get(k)
    if parts is None:
        if len(_META) >= 4096:
            _META.clear()
        parts = _META[k] = (string(1, dtype) + packed(2, shape) + packed(3, stride),
                            uint(5, nbytes) + boolean(6, requires_grad) + string(7, device))
    body = b"".join((parts[0], uint(4, offset), parts[1]))
    return b"".join((_LEN_KEY[2], varint(len(body)), body))


# Value's oneof members, by kind: always written, even at their default (a oneof member that is set is present).
_NONE = _VARINT_KEY[1] + b"\x01"
_TRUE, _FALSE = _VARINT_KEY[2] + b"\x01", _VARINT_KEY[2] + b"\x00"
_INT, _FLOAT, _TENSOR = _VARINT_KEY[3], _FIXED64_KEY[4], _VARINT_KEY[6]
_ELLIPSIS = _VARINT_KEY[13] + b"\x01"
_STR, _DTYPE, _DEVICE, _MEMORY_FORMAT, _LAYOUT, _OPAQUE = 5, 10, 11, 16, 17, 18
_TUPLE, _LIST, _DICT, _SLICE, _SIZE, _COMPLEX, _NAMED_TUPLE = 7, 8, 9, 12, 14, 15, 19


def _int(n: int) -> bytes:
    """Value.i: a sint64 (zigzag) oneof member, written even when 0."""
    return _INT + varint(((n << 1) ^ (n >> 63)) & _U64)


def _text(field: int, s: str) -> bytes:
    """A oneof string: written even when empty."""
    e = s.encode()
    return b"".join((_LEN_KEY[field], varint(len(e)), e))


class RecordEncoder:
    """Writes one record's values, and keeps the TensorMeta of each tensor met (`metas`, in table order, each an
    entry of Record.tensors). A subclass lays tensors out: `tensor()` appends the tensor's entry (`tensor_entry`)
    and returns its index. `value()`,
    `sequence()` and `mapping()` may be called for several trees of the same record."""

    def __init__(self) -> None:
        self.metas: list[bytes] = []
        self.size = 0

    def tensor(self, t: torch.Tensor, requires_grad: bool | None = None, device: str | None = None) -> int:
        raise NotImplementedError

    def value(self, obj: Any, hook: TensorHook | None = None) -> bytes:
        """The Value message of `obj`. `hook(t) -> dict` may give TensorMeta overrides (requires_grad, device)."""
        if obj is None:
            return _NONE
        if isinstance(obj, torch.Tensor):
            return _TENSOR + varint(self.tensor(obj, **hook(obj)) if hook else self.tensor(obj))
        if isinstance(obj, bool):
            return _TRUE if obj else _FALSE
        if isinstance(obj, int):
            if -(1 << 63) <= obj < (1 << 63):
                return _int(obj)
            return _FLOAT + struct.pack("<d", float(obj))
        if isinstance(obj, float):
            return _FLOAT + struct.pack("<d", obj)
        if isinstance(obj, torch.Size):   # before tuple: a Size is one
            return message(_SIZE, b"".join([message(1, _int(int(n))) for n in obj]))
        if isinstance(obj, tuple):
            named = hasattr(obj, "n_fields") or hasattr(obj, "_fields")
            return message(_NAMED_TUPLE if named else _TUPLE, self.sequence(obj, hook))
        if isinstance(obj, list):
            return message(_LIST, self.sequence(obj, hook))
        if isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                bad = next(k for k in obj if not isinstance(k, str))
                return _text(_OPAQUE, f"dict with {type(bad).__name__} keys")
            return message(_DICT, self.mapping(obj, hook))
        if isinstance(obj, complex):
            return message(_COMPLEX, _double(1, obj.real) + _double(2, obj.imag))
        if isinstance(obj, str):
            return _text(_STR, obj)
        if isinstance(obj, torch.dtype):
            return _text(_DTYPE, dtype_name(obj))
        if isinstance(obj, torch.device):
            return _text(_DEVICE, str(obj))
        if isinstance(obj, torch.memory_format):
            return _text(_MEMORY_FORMAT, _MEMORY_FORMAT_NAMES.get(obj, str(obj)))
        if isinstance(obj, torch.layout):
            return _text(_LAYOUT, _LAYOUT_NAMES.get(obj, str(obj)))
        if obj is Ellipsis:
            return _ELLIPSIS
        if isinstance(obj, slice):
            return message(_SLICE, b"".join([message(k, self.value(v, hook))
                                             for k, v in ((1, obj.start), (2, obj.stop), (3, obj.step))]))
        if isinstance(obj, Opaque):
            return _text(_OPAQUE, obj.type_name)
        return _text(_OPAQUE, type(obj).__qualname__[:200])

    def sequence(self, items: Sequence[Any], hook: TensorHook | None = None) -> bytes:
        """A Sequence message: each item a Value."""
        return b"".join([message(1, self.value(item, hook)) for item in items])

    def mapping(self, obj: dict[str, Any], hook: TensorHook | None = None) -> bytes:
        """A Mapping message: the keys, then the values in the same order."""
        values = [message(2, self.value(item, hook)) for item in obj.values()]
        return b"".join([*(_text(1, k) for k in obj), *values])
