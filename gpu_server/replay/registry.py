"""Name -> callable, for the APIs of the explicit allowlist only (protos/apis.py, docs/security.md).

A record's API name is looked up in the allowlist of its category first; only a listed name is then resolved, with
a fixed attribute lookup in its own namespace (torch.nn.functional, torch and its linalg/fft/special submodules,
torch.Tensor, torch.ops.aten) or in the fused-operator references. No eval, no import, no attribute lookup of an
unlisted string. The server's extension file (gpu_server/replay/extensions.py, docs/extensions.md) adds exactly the
custom
operators (`Custom.<namespace>.<op>`) and fused operators it gives a reference for; their arguments are checked by
kind there (`Reference.argument_problem`).
`replayable()` is what intake calls: the name and every argument are checked before a record is
acknowledged (their kinds in protos/apis.py, the values of index arguments against what they index in
gpu_server/replay/native_bounds.py), and a call that fails gets a SKIP row "not replayable: <why>".
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from gpu_server.replay import extensions
from gpu_server.replay.native_bounds import index_problem
from protos import apis
from protos.torch_compat import dispatcher_op_names

_SUBMODULES = (("linalg_", torch.linalg), ("fft_", torch.fft), ("special_", torch.special))


class UnknownApi(LookupError):
    pass


def _torch_fn(api: str) -> Callable[..., Any] | None:
    for prefix, module in _SUBMODULES:
        if api.startswith(prefix) and hasattr(module, api[len(prefix):]):
            fn: Callable[..., Any] = getattr(module, api[len(prefix):])
            return fn
    found: Callable[..., Any] | None = getattr(torch, api, None)
    return found


_ATEN_NAMES: frozenset[str] | None = None


def _aten_fn(api: str) -> Callable[..., Any] | None:
    """`torch.ops.aten.<api>` when the operator is registered on this host (looked up once, by set membership)."""
    global _ATEN_NAMES
    if _ATEN_NAMES is None:
        _ATEN_NAMES = frozenset(n[len("aten::"):].split(".", 1)[0] for n in dispatcher_op_names()
                                if n.startswith("aten::"))
    return getattr(torch.ops.aten, api) if api in _ATEN_NAMES else None


def resolve(category: str, api: str) -> Callable[..., Any]:
    """The callable for `Category.api` of the allowlist, or UnknownApi with the reason."""
    ref = extensions.reference_for(category, api)
    if ref is not None:   # named by the server's extension file: registered with the fused references
        from gpu_server.replay.fused import get_reference

        found = get_reference(ref.key)
        if found is None:
            raise UnknownApi(f"the reference of {category}.{api} from the extension file is not registered")
        return found
    if category == "Custom":
        raise UnknownApi(extensions.custom_op_message(api.replace(".", "::", 1)))
    why = apis.replayable(category, api)
    if why is not None:
        raise UnknownApi(why)
    if category == "NPU":
        from gpu_server.replay.fused import get_reference

        fn = get_reference(api)
        if fn is None:
            raise UnknownApi(f"no reference implementation for the fused operator {api} (see docs/fused_ops.md)")
        return fn
    return _torch_api(category, api)


@functools.lru_cache(maxsize=4096)
def _torch_api(category: str, api: str) -> Callable[..., Any]:
    """`Category.api` of torch's own namespaces, looked up once (torch's namespaces do not change while the server
    runs; a failed lookup is not kept: UnknownApi)."""
    if category == "Functional":
        fn = getattr(F, api, None)
    elif category == "Torch":
        fn = _torch_fn(api)
    elif category == "Tensor":
        fn = getattr(torch.Tensor, api, None)
    else:  # Aten
        fn = _aten_fn(api)
    if fn is None or not callable(fn):
        raise UnknownApi(f"{category}.{api} is not an API of torch {torch.__version__} on this host")
    return fn


def replayable(category: str, api: str, args: tuple[Any, ...] = (),
               kwargs: dict[str, Any] | None = None) -> str | None:
    """None if `Category.api(*args, **kwargs)` may be replayed here, else the reason for its SKIP row: a name on
    the allowlist that resolves on this host, arguments of allowed kinds, and index arguments within what they index
    (a native kernel dereferences them without a bound). A call the extension file gives a reference for: its
    arguments by kind (gpu_server/replay/extensions.py)."""
    ref = extensions.reference_for(category, api)
    if ref is not None:
        return ref.argument_problem(args, kwargs or {})
    if category == "Custom":
        return extensions.custom_op_message(api.replace(".", "::", 1))
    why = apis.replayable(category, api, args, kwargs)
    if why is not None:
        return why
    why = known(category, api)
    if why is not None:
        return why
    return index_problem(category, api, args, kwargs)


def known(category: str, api: str) -> str | None:
    """None if `Category.api` can be resolved here, else the reason it cannot (arguments not looked at)."""
    try:
        resolve(category, api)
        return None
    except UnknownApi as exc:
        return str(exc)


def is_device_string(api: str, value: Any, param: str | None = None) -> bool:
    """A device given as a string ('cpu', 'cuda:0', 'npu:0') where the API takes a device (`device=` of any API, or
    positionally to `to`/`cuda`/`cpu`): data, replaced by the bench device in the replay."""
    return apis.is_device_string(api, value, param)


def name_refused(category: str, api: str) -> bool:
    """Whether `Category.api` is refused by its name alone (an unknown category, a name outside the allowlist, a
    fused operator without a reference). The agent decides that at capture time and sends such calls with their
    reason and no tensors (npu_agent/capture.py), so a record that still asks for one breaks the wire contract: it
    is counted rejected. A valid record refused for its arguments, or for an API this host lacks, is counted
    `not replayable` instead (gpu_server/intake/admission.py)."""
    if category == "Custom" or extensions.reference_for(category, api) is not None:
        return False
    return apis.replayable(category, api) is not None
