"""Values and tensors <-> protobuf, on both sides of the wire: the names of dtypes, memory formats and layouts.

Encoding (agent): protos/record_bytes.py writes a snapshot tree (tuples, lists, dicts, tensors, scalars, dtypes,
...) as `Value` bytes plus a table of `TensorMeta`.

Decoding (server): `RecordDecoder` validates the whole tensor table against the payload and the limits first,
then rebuilds values. Nothing is executed, unpickled or looked up by name outside the fixed tables below.
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS, Limits

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("the online checker's wire format is little-endian; this host is big-endian")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16", "int32",
                 "int64", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
                 "float8_e4m3fnuz", "float8_e5m2fnuz")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPES = _DTYPES   # the dtypes a record may name, by name (gpu_server/_fastdecode.c looks them up here too)
_DTYPE_NAMES = {dt: name for name, dt in _DTYPES.items()}
_MEMORY_FORMATS = {name: getattr(torch, name) for name in ("contiguous_format", "channels_last", "channels_last_3d",
                                                           "preserve_format")}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_LAYOUT_NAMES = {v: k for k, v in _LAYOUTS.items()}
_ALIGN = 64  # tensor offsets inside the payload are aligned so that views of any dtype are aligned too


# An immutable payload (bytes) gives read-only tensor views: the server never writes into decoded tensors (every
# replay works on its own copies), so torch's "not writable" warning does not apply here (and only here).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=r"protos\.codec")


class WireError(ValueError):
    """A record that violates the wire contract or the limits. The message says what and where."""


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise WireError(f"unknown dtype {name[:64]!r}; supported: {', '.join(sorted(_DTYPES))}") from None


class Opaque:
    """Stands for an argument that could not cross the wire (decoded side). Its presence makes a call SKIP."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<opaque {self.type_name}>"


# dtype, shape, stride (empty: contiguous), offset, nbytes, and the strides of a contiguous tensor of that shape
_Layout = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int, tuple[int, ...]]


class _SeenMetas(dict[bytes, tuple[_Layout, bool]]):
    """Tensor metas already validated under one `Limits`, by their bytes: (layout, requires_grad). A training sends
    the same call sites' tensor tables over and over, so a meta is checked once; only its place in the payload is
    checked against each record's own size (`RecordDecoder.__init__`). At most `MAX` entries: when full it starts
    again empty (a client sending ever new metas costs itself the checks, nothing more)."""

    MAX = 4096
    MAX_KEY = 256   # bytes of a meta kept (a real one takes 20-60: a long device name is checked each time)

    def remember(self, key: bytes, entry: tuple[_Layout, bool]) -> tuple[_Layout, bool]:
        if len(key) <= self.MAX_KEY:
            if len(self) >= self.MAX:
                self.clear()
            self[key] = entry
        return entry


_SEEN: dict[int, tuple[Limits, _SeenMetas]] = {}   # by id(limits), the Limits kept so that its id is not reused


def _seen_metas(limits: Limits) -> _SeenMetas:
    found = _SEEN.get(id(limits))
    if found is None:
        if len(_SEEN) >= 8:
            _SEEN.clear()
        found = _SEEN[id(limits)] = (limits, _SeenMetas())
    return found[1]


class RecordDecoder:
    """Validates a record's tensor table against its payload and rebuilds its values.

    `payload` is the assembled bytes (bytes or bytearray): tensors are views into it and share its memory, so they
    are read-only to the server (every replay works on its own copies).
    """

    def __init__(self, record: pb.Record, payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS,
                 keys: Sequence[bytes] | None = None, payload_bytes: int | None = None):
        """`keys`, `payload_bytes`: each tensor meta's bytes and the payload size, where the caller read them off
        the record's bytes already (gpu_server/_fastdecode.c): a meta's bytes are the key it is checked under, and
        only a meta not seen before is read from `record`."""
        self.limits = limits
        self.record = record
        self.payload = payload
        self._tensors: dict[int, torch.Tensor] = {}
        self._whole: dict[torch.dtype, torch.Tensor] = {}   # the payload as one tensor of each dtype read so far
        self._count = 0
        self._max_values, self._max_depth = limits.max_values, limits.max_depth
        announced = record.payload_bytes if payload_bytes is None else payload_bytes
        if len(payload) != announced:
            raise WireError(f"payload is {len(payload)} bytes but the record announces {announced}")
        metas = record.tensors
        self._n = len(metas) if keys is None else len(keys)
        if self._n > limits.max_tensors:
            raise WireError(f"{self._n} tensors in one record exceed the limit of {limits.max_tensors}")
        # each tensor's layout as validated, read off its meta once (_Layout)
        self._layouts: list[_Layout] = []
        self.requires_grad: list[int] = []   # indices of the tensors whose meta says requires_grad
        seen = _seen_metas(limits)
        for i, key in enumerate(keys if keys is not None else (meta.SerializeToString() for meta in metas)):
            known = seen.get(key)
            if known is None:
                meta = metas[i]
                known = seen.remember(key, (self._check_meta(i, meta), meta.requires_grad))
            else:   # a meta seen before: only its place is checked against this record's payload
                self._inside(i, known[0][3], known[0][4])
            layout, grad = known
            self._layouts.append(layout)
            if grad:
                self.requires_grad.append(i)

    def _check_meta(self, i: int, meta: pb.TensorMeta) -> _Layout:
        lim = self.limits
        dtype = dtype_from_name(meta.dtype)
        shape = tuple(meta.shape)
        if len(shape) > lim.max_dims:
            raise WireError(f"tensor {i}: {len(shape)} dimensions exceed the limit of {lim.max_dims}")
        numel = 1
        for d in shape:
            if d < 0:
                raise WireError(f"tensor {i}: negative dimension {d} in shape {list(shape)}")
            numel *= d
            if numel > lim.max_numel:
                raise WireError(f"tensor {i}: shape {list(shape)} exceeds the limit of {lim.max_numel} elements")
        elsize = dtype.itemsize
        nbytes, offset = meta.nbytes, meta.offset
        if nbytes != numel * elsize:
            raise WireError(f"tensor {i}: {nbytes} bytes do not match shape {list(shape)} of {meta.dtype} "
                            f"({numel * elsize} bytes)")
        self._inside(i, offset, nbytes)
        stride = tuple(meta.stride)
        if stride:
            if len(stride) != len(shape):
                raise WireError(f"tensor {i}: {len(stride)} strides for {len(shape)} dimensions")
            if numel and any(s < 0 for s in stride):
                raise WireError(f"tensor {i}: negative stride in {list(stride)}")
            if numel and not _dense(shape, stride):
                raise WireError(f"tensor {i}: strides {list(stride)} do not describe a dense, non-overlapping "
                                f"layout of shape {list(shape)} (the payload holds each element once)")
        if len(meta.device) > lim.max_string_len:
            raise WireError(f"tensor {i}: device name longer than {lim.max_string_len}")
        return dtype, shape, stride, offset, nbytes, _contiguous(shape)

    def _inside(self, i: int, offset: int, nbytes: int) -> None:
        """Tensor `i`'s bytes lie within the payload."""
        if offset + nbytes > len(self.payload):
            raise WireError(f"tensor {i}: bytes {offset}..{offset + nbytes} lie outside the "
                            f"{len(self.payload)}-byte payload")

    def tensor(self, index: int) -> torch.Tensor:
        cached = self._tensors.get(index)
        if cached is not None:
            return cached
        if index >= self._n:
            raise WireError(f"tensor index {index} but the record has {self._n} tensors")
        try:
            t = self._build(*self._layouts[index])
        except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
            if isinstance(exc, WireError):
                raise
            # every meta was validated in __init__; this is a safety net, so no record can escape as a crash
            raise WireError(f"tensor {index} cannot be rebuilt from its meta: {str(exc)[:200]}") from None
        self._tensors[index] = t
        return t

    def _build(self, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], offset: int,
               nbytes: int, dense: tuple[int, ...]) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        size = dtype.itemsize
        if self._n > 2 and not stride and not offset % size and not dtype.is_complex:
            # a dense tensor of a record with three or more, at an offset its element size divides: a view of the
            # payload read once as a tensor of its dtype (as_strided costs half a frombuffer of its own: from the
            # third tensor on, sharing one is cheaper)
            whole = self._whole.get(dtype)
            if whole is None:
                whole = self._whole[dtype] = torch.frombuffer(self.payload, dtype=dtype,
                                                              count=len(self.payload) // size)
            return whole.as_strided(shape, dense, offset // size)
        if dtype.is_complex:
            real = torch.float32 if dtype == torch.complex64 else torch.float64
            flat = torch.frombuffer(self.payload, dtype=real, count=nbytes // real.itemsize, offset=offset)
            t = torch.view_as_complex(flat.reshape(-1, 2)).reshape(shape)
        else:
            # the elements' bytes at their offset (any offset: x86 and ARM read unaligned elements), one dimension
            t = torch.frombuffer(self.payload, dtype=dtype, count=nbytes // size, offset=offset)
            if len(shape) != 1:
                t = t.reshape(shape)
        if stride and t.numel():
            strided = torch.empty_strided(shape, stride, dtype=dtype)
            strided.copy_(t)
            t = strided
        return t

    def meta(self, index: int) -> pb.TensorMeta:
        return self.record.tensors[index]

    def value(self, v: pb.Value, depth: int = 0) -> Any:
        self._count += 1
        if self._count > self._max_values:
            raise WireError(f"more than {self._max_values} values in one record")
        if depth > self._max_depth:
            raise WireError(f"values nested deeper than {self._max_depth}")
        kind = v.WhichOneof("kind")
        if kind == "tensor":   # (the most frequent kind, first)
            return self.tensor(v.tensor)
        if kind is None or kind == "none":
            return None
        if kind in ("b", "i", "f"):
            return getattr(v, kind)
        if kind == "s":
            return self._string(v.s)
        if kind == "c":
            return complex(v.c.real, v.c.imag)
        if kind in ("tuple", "named_tuple"):
            return tuple(self.value(x, depth + 1) for x in getattr(v, kind).items)
        if kind == "list":
            return [self.value(x, depth + 1) for x in v.list.items]
        if kind == "size":
            return torch.Size([self._int(x) for x in v.size.items])
        if kind == "dict":
            return self.mapping(v.dict, depth + 1)
        if kind == "dtype":
            return dtype_from_name(v.dtype)
        if kind == "device":
            return self._device(v.device)
        if kind == "slice":
            return slice(self.value(v.slice.start, depth + 1), self.value(v.slice.stop, depth + 1),
                         self.value(v.slice.step, depth + 1))
        if kind == "ellipsis":
            return Ellipsis
        if kind == "memory_format":
            if v.memory_format not in _MEMORY_FORMATS:
                raise WireError(f"unknown memory format {v.memory_format[:64]!r}")
            return _MEMORY_FORMATS[v.memory_format]
        if kind == "layout":
            if v.layout not in _LAYOUTS:
                raise WireError(f"unknown layout {v.layout[:64]!r}")
            return _LAYOUTS[v.layout]
        if kind == "opaque":
            return Opaque(self._string(v.opaque))
        raise WireError(f"unknown value kind {kind}")  # pragma: no cover - the oneof is closed

    def mapping(self, m: pb.Mapping, depth: int = 0) -> dict[str, Any]:
        if len(m.keys) != len(m.values):
            raise WireError(f"mapping with {len(m.keys)} keys but {len(m.values)} values")
        return {self._string(k): self.value(x, depth + 1) for k, x in zip(m.keys, m.values)}

    def _string(self, s: str) -> str:
        if len(s) > self.limits.max_string_len:
            raise WireError(f"string of {len(s)} characters exceeds the limit of {self.limits.max_string_len}")
        return s

    def _int(self, v: pb.Value) -> int:
        if v.WhichOneof("kind") != "i":
            raise WireError("torch.Size entries must be integers")
        return v.i

    def _device(self, name: str) -> torch.device | Opaque:
        name = self._string(name)
        try:
            return torch.device(name)
        except (RuntimeError, ValueError):
            # A device type the bench host does not know (npu on a GPU host): keep the name, replay moves it.
            return Opaque(f"device {name}")


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    stride = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        stride[i - 1] = stride[i] * shape[i]
    return tuple(stride)


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True when `stride` lays out every element of `shape` exactly once, with no gap and no overlap: a
    permutation of contiguous strides (dimensions of size 1 may have any stride). Zero or repeated strides (an
    expanded tensor) would make several elements share one memory location, which the decoder cannot fill."""
    expected = 1
    for size, st in sorted(((d, s) for d, s in zip(shape, stride) if d != 1), key=lambda ds: (ds[1], ds[0])):
        if st != expected:
            return False
        expected *= size
    return True


# The shared-folder transport's names and layout moved to protos/folder_format.py; re-exported here until every
# importer uses that module.
from protos.folder_format import FOLDER_MAGIC as FOLDER_MAGIC  # noqa: E402
from protos.folder_format import folder_end_name as folder_end_name  # noqa: E402
from protos.folder_format import folder_record_name as folder_record_name  # noqa: E402
