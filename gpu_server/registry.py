"""Name -> callable, built once from torch and the fused-op references (SPEC §5.2).

Only names in these tables can be replayed: a record's API name is looked up here and nowhere else (no eval, no
getattr on strings outside the tables). Unknown names are SKIP with the reason.
"""
from __future__ import annotations

import functools
import types
from typing import Callable

import torch
import torch.nn.functional as F


def _callables(namespace, prefix: str = "") -> dict[str, Callable]:
    out = {}
    for name, obj in vars(namespace).items():
        if name.startswith("_") or isinstance(obj, (type, types.ModuleType)) or not callable(obj):
            continue
        out[prefix + name] = obj
    return out


@functools.lru_cache(maxsize=1)
def _tables() -> dict[str, dict[str, Callable]]:
    torch_fns = _callables(torch)
    for ns, prefix in ((torch.linalg, "linalg_"), (torch.fft, "fft_"), (torch.special, "special_")):
        torch_fns.update(_callables(ns, prefix))
    for name in dir(torch):
        if name.startswith(("_foreach_", "_fused_")):
            torch_fns[name] = getattr(torch, name)
    tensor_fns = {}
    for name in dir(torch.Tensor):
        if name.startswith("_") and not name.startswith("__"):
            continue
        obj = getattr(torch.Tensor, name, None)
        if callable(obj) and not isinstance(obj, (type, property)):
            tensor_fns[name] = obj
    aten_ops = {n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()
                if n.startswith("aten::")}
    return {"Functional": _callables(F), "Torch": torch_fns, "Tensor": tensor_fns, "Aten": dict.fromkeys(aten_ops)}


class UnknownApi(LookupError):
    pass


def resolve(category: str, api: str) -> Callable:
    """The callable for `Category.api`, or UnknownApi with the reason."""
    if category == "Distributed":
        raise UnknownApi("collective communication is not replayed on the benchmark host")
    if category == "NPU":
        from gpu_server.fused import get_reference

        fn = get_reference(api)
        if fn is None:
            raise UnknownApi(f"no reference implementation for the fused operator {api} (see docs/fused_ops.md)")
        return fn
    table = _tables().get(category)
    if table is None:
        raise UnknownApi(f"unknown API category {category!r}")
    if api not in table:
        raise UnknownApi(f"{category}.{api} is not an API of torch {torch.__version__} on this host")
    if category == "Aten":
        return getattr(torch.ops.aten, api)  # api is in the set of registered aten operator names
    return table[api]


def known(category: str, api: str) -> str | None:
    """None if `Category.api` can be replayed here, else the reason it cannot."""
    try:
        resolve(category, api)
        return None
    except UnknownApi as exc:
        return str(exc)
