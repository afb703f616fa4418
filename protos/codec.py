"""Values and tensors <-> protobuf, on both sides of the wire.

Encoding (agent): `RecordEncoder` turns a snapshot tree (tuples, lists, dicts, tensors, scalars, dtypes, ...)
into `Value` messages plus a table of `TensorMeta` and a list of zero-copy byte views of the tensors.

Decoding (server): `RecordDecoder` validates the whole tensor table against the payload and the limits first,
then rebuilds values. Nothing is executed, unpickled or looked up by name outside the fixed tables below.
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS, Limits

TensorHook = Callable[[torch.Tensor], dict[str, Any]]   # TensorMeta overrides for one tensor

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("the online checker's wire format is little-endian; this host is big-endian")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16", "int32",
                 "int64", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
                 "float8_e4m3fnuz", "float8_e5m2fnuz")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
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


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy is a buffer


class RecordEncoder:
    """Accumulates the tensors of one record. `value()` may be called for several trees of the same record."""

    def __init__(self) -> None:
        self.metas: list[pb.TensorMeta] = []
        self.buffers: list[tuple[int, memoryview]] = []  # (offset, bytes)
        self.size = 0

    def tensor(self, t: torch.Tensor, requires_grad: bool | None = None, device: str | None = None) -> int:
        t = t.detach()
        meta = pb.TensorMeta(dtype=dtype_name(t.dtype), shape=list(t.shape),
                             requires_grad=t.requires_grad if requires_grad is None else requires_grad,
                             device=device or str(t.device))
        if t.layout != torch.strided:
            raise TypeError(f"{t.layout} tensors are not supported on the wire")
        if not t.is_contiguous():
            meta.stride.extend(t.stride())
            t = t.contiguous()
        if t.device.type != "cpu":
            t = t.to("cpu")
        view = tensor_bytes(t)
        self.size = (self.size + _ALIGN - 1) // _ALIGN * _ALIGN
        meta.offset, meta.nbytes = self.size, view.nbytes
        self.size += view.nbytes
        self.metas.append(meta)
        self.buffers.append((meta.offset, view))
        return len(self.metas) - 1

    def value(self, obj: Any, tensor_hook: TensorHook | None = None) -> pb.Value:
        """Encode `obj`. `tensor_hook(t) -> dict` may give TensorMeta overrides (requires_grad, device)."""
        if obj is None:
            return pb.Value(none=True)
        if isinstance(obj, torch.Tensor):
            extra = tensor_hook(obj) if tensor_hook else {}
            return pb.Value(tensor=self.tensor(obj, **extra))
        if isinstance(obj, bool):
            return pb.Value(b=obj)
        if isinstance(obj, int):
            if -(1 << 63) <= obj < (1 << 63):
                return pb.Value(i=obj)
            return pb.Value(f=float(obj))
        if isinstance(obj, float):
            return pb.Value(f=obj)
        if isinstance(obj, complex):
            return pb.Value(c=pb.Complex(real=obj.real, imag=obj.imag))
        if isinstance(obj, str):
            return pb.Value(s=obj)
        if isinstance(obj, torch.dtype):
            return pb.Value(dtype=dtype_name(obj))
        if isinstance(obj, torch.device):
            return pb.Value(device=str(obj))
        if isinstance(obj, torch.Size):
            return pb.Value(size=pb.Sequence(items=[pb.Value(i=int(v)) for v in obj]))
        if isinstance(obj, torch.memory_format):
            return pb.Value(memory_format=_MEMORY_FORMAT_NAMES.get(obj, str(obj)))
        if isinstance(obj, torch.layout):
            return pb.Value(layout=_LAYOUT_NAMES.get(obj, str(obj)))
        if obj is Ellipsis:
            return pb.Value(ellipsis=True)
        if isinstance(obj, slice):
            return pb.Value(slice=pb.Slice(start=self.value(obj.start, tensor_hook),
                                           stop=self.value(obj.stop, tensor_hook),
                                           step=self.value(obj.step, tensor_hook)))
        if isinstance(obj, tuple):
            items = [self.value(v, tensor_hook) for v in obj]
            if hasattr(obj, "n_fields") or hasattr(obj, "_fields"):
                return pb.Value(named_tuple=pb.Sequence(items=items))
            return pb.Value(tuple=pb.Sequence(items=items))
        if isinstance(obj, list):
            return pb.Value(list=pb.Sequence(items=[self.value(v, tensor_hook) for v in obj]))
        if isinstance(obj, dict):
            keys, values = [], []
            for k, v in obj.items():
                if not isinstance(k, str):
                    return pb.Value(opaque=f"dict with {type(k).__name__} keys")
                keys.append(k)
                values.append(self.value(v, tensor_hook))
            return pb.Value(dict=pb.Mapping(keys=keys, values=values))
        if isinstance(obj, Opaque):
            return pb.Value(opaque=obj.type_name)
        return pb.Value(opaque=type(obj).__qualname__[:200])

    def mapping(self, obj: dict[str, Any], tensor_hook: TensorHook | None = None) -> pb.Mapping:
        return self.value(obj, tensor_hook).dict


class RecordDecoder:
    """Validates a record's tensor table against its payload and rebuilds its values.

    `payload` is the assembled bytes (bytes or bytearray): tensors are views into it and share its memory, so they
    are read-only to the server (every replay works on its own copies).
    """

    def __init__(self, record: pb.Record, payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS):
        self.limits = limits
        self.record = record
        self.payload = payload
        self._tensors: dict[int, torch.Tensor] = {}
        self._count = 0
        if len(payload) != record.payload_bytes:
            raise WireError(f"payload is {len(payload)} bytes but the record announces {record.payload_bytes}")
        if len(record.tensors) > limits.max_tensors:
            raise WireError(f"{len(record.tensors)} tensors in one record exceed the limit of {limits.max_tensors}")
        for i, meta in enumerate(record.tensors):
            self._check_meta(i, meta)

    def _check_meta(self, i: int, meta: pb.TensorMeta) -> None:
        lim = self.limits
        dtype = dtype_from_name(meta.dtype)
        if len(meta.shape) > lim.max_dims:
            raise WireError(f"tensor {i}: {len(meta.shape)} dimensions exceed the limit of {lim.max_dims}")
        numel = 1
        for d in meta.shape:
            if d < 0:
                raise WireError(f"tensor {i}: negative dimension {d} in shape {list(meta.shape)}")
            numel *= d
            if numel > lim.max_numel:
                raise WireError(f"tensor {i}: shape {list(meta.shape)} exceeds the limit of {lim.max_numel} elements")
        elsize = torch.empty((), dtype=dtype).element_size()
        if meta.nbytes != numel * elsize:
            raise WireError(f"tensor {i}: {meta.nbytes} bytes do not match shape {list(meta.shape)} of {meta.dtype} "
                            f"({numel * elsize} bytes)")
        if meta.offset + meta.nbytes > len(self.payload):
            raise WireError(f"tensor {i}: bytes {meta.offset}..{meta.offset + meta.nbytes} lie outside the "
                            f"{len(self.payload)}-byte payload")
        if meta.stride:
            if len(meta.stride) != len(meta.shape):
                raise WireError(f"tensor {i}: {len(meta.stride)} strides for {len(meta.shape)} dimensions")
            if numel and any(s < 0 for s in meta.stride):
                raise WireError(f"tensor {i}: negative stride in {list(meta.stride)}")
            if numel and not _dense(meta.shape, meta.stride):
                raise WireError(f"tensor {i}: strides {list(meta.stride)} do not describe a dense, non-overlapping "
                                f"layout of shape {list(meta.shape)} (the payload holds each element once)")
        if len(meta.device) > lim.max_string_len:
            raise WireError(f"tensor {i}: device name longer than {lim.max_string_len}")

    def tensor(self, index: int) -> torch.Tensor:
        if index >= len(self.record.tensors):
            raise WireError(f"tensor index {index} but the record has {len(self.record.tensors)} tensors")
        cached = self._tensors.get(index)
        if cached is not None:
            return cached
        try:
            t = self._build(self.record.tensors[index])
        except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
            if isinstance(exc, WireError):
                raise
            # every meta was validated in __init__; this is a safety net, so no record can escape as a crash
            raise WireError(f"tensor {index} cannot be rebuilt from its meta: {str(exc)[:200]}") from None
        self._tensors[index] = t
        return t

    def _build(self, meta: pb.TensorMeta) -> torch.Tensor:
        dtype = dtype_from_name(meta.dtype)
        shape = tuple(meta.shape)
        if meta.nbytes == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            flat = torch.frombuffer(self.payload, dtype=torch.uint8, count=meta.nbytes, offset=meta.offset)
            if dtype.is_complex:
                real = torch.float32 if dtype == torch.complex64 else torch.float64
                t = torch.view_as_complex(flat.view(real).reshape(-1, 2)).reshape(shape)
            else:
                t = flat.view(dtype).reshape(shape)
        if meta.stride and t.numel():
            strided = torch.empty_strided(shape, tuple(meta.stride), dtype=dtype)
            strided.copy_(t)
            t = strided
        return t

    def meta(self, index: int) -> pb.TensorMeta:
        return self.record.tensors[index]

    def value(self, v: pb.Value, depth: int = 0) -> Any:
        self._count += 1
        if self._count > self.limits.max_values:
            raise WireError(f"more than {self.limits.max_values} values in one record")
        if depth > self.limits.max_depth:
            raise WireError(f"values nested deeper than {self.limits.max_depth}")
        kind = v.WhichOneof("kind")
        if kind is None or kind == "none":
            return None
        if kind in ("b", "i", "f"):
            return getattr(v, kind)
        if kind == "s":
            return self._string(v.s)
        if kind == "c":
            return complex(v.c.real, v.c.imag)
        if kind == "tensor":
            return self.tensor(v.tensor)
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


def encode_frames(record: pb.Record, buffers: list[tuple[int, memoryview]], payload_bytes: int,
                  chunk_bytes: int) -> Iterator[bytes]:
    """Yield one record as Frame messages (bytes) carrying at most chunk_bytes of payload each.

    The payload is appended as Frame.data (field 15, the last on the wire) by concatenation, so each tensor's
    bytes are copied exactly once, into the outgoing message.
    """
    record.payload_bytes = payload_bytes
    seq = record.header.seq
    first = True
    head = pb.Frame(record=record).SerializeToString()
    pos = 0
    pieces: list[bytes | memoryview] = []
    chunk_start = 0
    bi = 0
    while True:
        # Gather up to chunk_bytes of payload starting at `pos` (padding between tensors is zeros).
        want = min(chunk_bytes, payload_bytes - pos)
        chunk_start = pos
        pieces = []
        while want > 0:
            if bi < len(buffers) and buffers[bi][0] <= pos:
                off, view = buffers[bi]
                start = pos - off
                take = min(want, view.nbytes - start)
                if take > 0:
                    pieces.append(view[start:start + take])
                    pos += take
                    want -= take
                if pos >= off + view.nbytes:
                    bi += 1
                continue
            gap_end = buffers[bi][0] if bi < len(buffers) else payload_bytes
            take = min(want, gap_end - pos)
            pieces.append(bytes(take))
            pos += take
            want -= take
        n = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in pieces)
        prefix = head if first else pb.Frame(chunk=pb.Chunk(seq=seq, offset=chunk_start)).SerializeToString()
        first = False
        yield b"".join([prefix, b"\x7a", _varint(n), *pieces]) if n else prefix
        if pos >= payload_bytes:
            return


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# -- the shared-folder transport's files (npu_agent/transport_folder.py writes them, gpu_server/folder.py reads) --
# A file is FOLDER_MAGIC, then frames, each a 4-byte little-endian length and one serialized Frame (the same bytes
# as on the gRPC stream). Names carry the run id, rank and sequence number; nothing in a file names a path.
FOLDER_MAGIC = b"OCFRAME1"


def folder_record_name(run_id: str, rank: int, seq: int) -> str:
    return f"{run_id}.rank{rank}.{seq:012d}.rec"


def folder_end_name(run_id: str, rank: int) -> str:
    return f"{run_id}.rank{rank}.end"
