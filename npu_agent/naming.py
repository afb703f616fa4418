"""Which calls are APIs, and what they are called: `{Category}.{api}.{n}` (docs/design.md §4).

A custom operator (`torch.ops.<ns>.<op>` of a namespace that is neither aten, npu, nor one of torch's own) is
`Custom.<ns>.<op>.n`: category Custom, api `<ns>.<op>`, its overload name dropped.

`classify(func)` maps the function object the mode receives to (category, api) or None (not an API: metadata,
properties, autograd entry points, profiler ops). The decision is cached per function object. `Counters` gives
the per-step call index.
"""
from __future__ import annotations

import types
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from npu_agent import collectives
from protos import apis
from protos.limits import API_NAME
from protos.torch_compat import op_overload_name, tensor_base_class

# Tensor methods and torch functions that read metadata, move no numbers, or drive autograd: never records.
_NOT_APIS = frozenset("""
dim size numel nelement stride is_contiguous data_ptr element_size storage_offset untyped_storage storage _typed_storage
is_floating_point is_complex is_signed get_device __len__ __bool__ __int__ __float__ __index__ __hash__ __repr__
__format__ __reduce_ex__ __reduce__ __deepcopy__ __setstate__ __getstate__ __array__ __array_wrap__ __dlpack__
__dlpack_device__ __iter__ __contains__ __dir__ __sizeof__ numpy tolist item register_hook retain_grad requires_grad_
backward detach detach_ type is_pinned is_shared share_memory_ pin_memory is_set_to has_names is_inference
is_tensor is_grad_enabled is_inference_mode_enabled is_autocast_enabled is_storage numel is_nonzero is_same_size
is_conj is_neg is_leaf _is_view is_meta is_cuda is_cpu grad_fn register_post_accumulate_grad_hook
_backward_hooks __torch_function__ __torch_dispatch__ as_subclass _make_subclass __instancecheck__ __class__
autograd_backward grad new_tensor __get__ __set__ __delete__ data_ptr _version __cuda_array_interface__
""".split())

_SKIP_NAMESPACES = frozenset({"profiler", "prim", "prims", "debugprims", "_c10d_functional", "c10d",
                              "_dtensor", "_c10d_functional_autograd", "_quantized", "higher_order"})
# Operator namespaces torch itself registers (torch 2.13: `torch._C._dispatch_get_all_op_names()`): torch's own
# kernels (FSDP2's copy-in, inductor's accumulate_grad_, quantized and oneDNN kernels, symmetric memory), not a
# training's custom operators. Not APIs, as before custom operators were recorded; their writes are still protected.
_TORCH_NAMESPACES = frozenset({"quantized", "quantization", "symm_mem", "static_runtime", "onednn", "mkldnn",
                               "mkldnn_prepacked", "mkl", "c10d_functional", "sparse", "inductor", "inductor_prims",
                               "fsdp", "_test", "rngprims", "_native", "debug_mode_ops", "export"})
_CUSTOM = "Custom"

# Which APIs draw random numbers (their generator state is recorded) and which dropout calls carry their keep-mask:
# the lists are shared with the server (protos/apis.py).
DROPOUT_MASKED = apis.DROPOUT_MASKED


# APIs that write some of their tensor arguments without an in-place name: their inputs are copied before the call.
WRITES_INPUTS = frozenset({("Functional", "batch_norm"), ("Torch", "batch_norm"), ("Functional", "instance_norm"),
                           ("Torch", "instance_norm"), ("Torch", "native_batch_norm"),
                           ("Torch", "_native_batch_norm_legit"), ("Aten", "native_batch_norm"),
                           ("Aten", "_native_batch_norm_legit"), ("Aten", "_native_batch_norm_legit_functional")})


def _public_callables(namespace: types.ModuleType, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, obj in vars(namespace).items():
        if name.startswith("_") or isinstance(obj, (type, types.ModuleType)) or not callable(obj):
            continue
        yield prefix + name, obj


def _build_tables() -> dict[int, tuple[str, str]]:
    table: dict[int, tuple[str, str]] = {}
    sub = [(torch.linalg, "linalg_"), (torch.fft, "fft_"), (torch.special, "special_")]
    for ns, prefix in [(torch, "")] + sub:
        for name, obj in _public_callables(ns, prefix):
            table[id(obj)] = ("Torch", name)
    for name in dir(torch):  # torch's private fused and foreach kernels are APIs the optimizer calls
        if name.startswith(("_foreach_", "_fused_")):
            table[id(getattr(torch, name))] = ("Torch", name)
    for name, obj in _public_callables(F):  # Functional wins where F and torch share an object (conv2d, ...)
        table[id(obj)] = ("Functional", name)
    return table


_TABLE: dict[int, tuple[str, str]] | None = None
_KEEP: list[Any] = []  # keep classified function objects alive so their ids stay valid


def _classify_uncached(func: Any) -> tuple[str, str] | None:
    global _TABLE
    if _TABLE is None:
        _TABLE = _build_tables()
    op_name = op_overload_name(func)
    if op_name is not None:
        # `torch.ops.npu.op(...)` reaches the mode as the packet, `torch.ops.npu.op.default(...)` as the overload
        ns, op = op_name
        if ns == "_c10d_functional" and (op in collectives.FUNCTIONAL or op == collectives.WAIT):
            return ("Distributed", op)   # functional collectives, their output at wait_tensor (npu_agent.collectives)
        if ns in _SKIP_NAMESPACES:
            return None
        if ns == "aten":
            return ("Aten", op)
        if ns == "npu":
            return ("NPU", op)
        if ns in _TORCH_NAMESPACES:
            return None
        # A custom operator (torch.library.custom_op, Library.define, a C++ extension): `Custom.<ns>.<op>.n`, every
        # overload under the one api (the server resolves a reference by (namespace, operator)). A custom_op's
        # Python wrapper (CustomOpDef.__call__) reaches the mode once, as its default OpOverload.
        return (_CUSTOM, f"{ns}.{op}") if _custom_name_ok(ns, op) else None
    name = getattr(func, "__name__", None)
    if not isinstance(name, str) or name in _NOT_APIS:
        return None
    if isinstance(func, type):   # a constructor the mode sees (torch.device(...), torch.Generator(...)): not an API
        return None
    hit = _TABLE.get(id(func))
    if hit is not None:
        return hit
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch.distributed"):
        # all_gather_into_tensor reaches the mode as all_gather_single (and kin): named as the API the server knows
        return ("Distributed", collectives.ALIASES.get(name, name))
    if module.startswith("torch_npu"):
        return ("NPU", name)
    owner = getattr(func, "__objclass__", None)
    qual = getattr(func, "__qualname__", "") or ""
    if owner in (tensor_base_class(), torch.Tensor) or qual.startswith(("Tensor.", "TensorBase.")):
        if name.startswith("_") and not name.startswith("__"):
            return None
        return ("Tensor", name)
    if module.startswith("torch.nn.functional"):
        return ("Functional", name)
    if module.startswith("torch.autograd") or module.startswith("torch._C") or name.startswith("_"):
        return None
    if module == "torch" or module.startswith(("torch.functional", "torch._refs", "torch.linalg", "torch.fft",
                                               "torch.special")):
        return ("Torch", name)
    return None


def _custom_name_ok(ns: str, op: str) -> bool:
    """Both parts identifiers the wire accepts (protos.limits.CALL_NAME); else the call stays unrecorded."""
    return API_NAME.match(ns) is not None and API_NAME.match(op) is not None


_CACHE: dict[Any, tuple[str, str] | None] = {}
CLASSIFIED = _CACHE   # read-only view for the capture mode's fast path (cleared in place, never rebound)


def classify(func: Any) -> tuple[str, str] | None:
    """(category, api) for an API function object, None for anything that is not a record."""
    try:
        return _CACHE[func]
    except KeyError:
        pass
    except TypeError:  # unhashable callable
        return _classify_uncached(func)
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__", "__delete__"):  # property accessors: new objects on every access
        return None
    info = _classify_uncached(func)
    _CACHE[func] = info
    _KEEP.append(func)
    return info


def register_npu_namespace(module: types.ModuleType) -> int:
    """Add torch_npu's public functions as NPU APIs (called only when torch_npu is importable)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _build_tables()
    count = 0
    for name, obj in _public_callables(module):
        if name.startswith("npu_"):
            _TABLE[id(obj)] = ("NPU", name)
            _KEEP.append(obj)
            count += 1
    _CACHE.clear()
    return count


def is_random(api: str) -> bool:
    return apis.is_random(api)


_INPLACE_NAMES: dict[str, bool] = {}


def inplace_by_name(api: str) -> bool:
    """In-place by name: `add_`, `__iadd__`, `__setitem__` (cached per name)."""
    hit = _INPLACE_NAMES.get(api)
    if hit is None:
        hit = ((api.endswith("_") and not api.endswith("__"))
               or (api.startswith("__i") and api.endswith("__") and api not in ("__init__", "__invert__", "__index__"))
               or api == "__setitem__")
        _INPLACE_NAMES[api] = hit
    return hit


def is_inplace(api: str, kwargs: dict[str, Any]) -> bool:
    """In-place by name (`add_`, `__iadd__`, `__setitem__`) or by keyword (`inplace=True`, `out=`)."""
    return inplace_by_name(api) or kwargs.get("inplace") is True or kwargs.get("out") is not None


class Counters:
    """Per-step call counters: `Functional.linear` -> 0, 1, 2, ... reset by `reset()` at each step boundary."""

    def __init__(self) -> None:
        self._n: dict[tuple[str, str], int] = {}
        self.counts = self._n   # (category, api) -> calls so far this step; `reset` empties it in place

    def next_name(self, category: str, api: str) -> str:
        key = (category, api)
        n = self._n.get(key, 0)
        self._n[key] = n + 1
        return f"{category}.{api}.{n}"

    def reset(self) -> None:
        self._n.clear()


def matches_list(full_name: str, entries: tuple[str, ...]) -> bool:
    """msprobe's `list` filter: an entry matches the full name, `Category.api`, or the bare api."""
    if not entries:
        return True
    qualified = full_name.rsplit(".", 1)[0]
    bare = qualified.split(".", 1)[-1]
    return any(e in (full_name, qualified, bare) for e in entries)
