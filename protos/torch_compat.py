"""Every private or undocumented PyTorch API the agent and the server use, each behind one small named function.

PyTorch may change these in any release without notice. Keeping them here means a torch upgrade is checked in one
place: `tests/test_torch_compat.py` exercises each function the way its caller relies on it and fails naming the
torch version. Call sites use these functions, never the private names themselves.

| function | private API | used for |
|---|---|---|
| `function_mode_stack` | `torch.overrides._get_current_function_mode_stack` | is the capture mode pushed, and on top? |
| `in_backward_pass` | `torch._C._current_graph_task_id` | a call made by the autograd engine (recompute) |
| `disable_torch_function` | `torch._C.DisableTorchFunction` | copy a gradient without our mode seeing it |
| `queue_backward_callback` | `Variable._execution_engine.queue_callback` | run once when this backward pass ends |
| `op_overload_name` | `torch._ops.OpOverload(Packet)`, `._schema`, `._qualified_op_name` | name a `torch.ops` call |
| `tensor_base_class` | `torch._C.TensorBase` | the class that owns Tensor's C methods |
| `dispatcher_op_names` | `torch._C._dispatch_get_all_op_names` | the aten operators this torch registers |
| `reentrant_checkpoint_function` | `torch.utils.checkpoint.CheckpointFunction` | wrap reentrant checkpointing |
| `tensor_version` | `Tensor._version` | did a held tensor change in place since capture? |
| `written_arguments` | `OpOverload._schema`, `.arguments`, `Argument.alias_info.is_write` | `Tensor(a!)` arguments |
| `find_operator` | `torch.ops.<namespace>.<name>` looked up by name | the operator of a `torch_npu.npu_*` function |
"""
from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["function_mode_stack", "in_backward_pass", "disable_torch_function", "queue_backward_callback",
           "op_overload_name", "tensor_base_class", "dispatcher_op_names", "reentrant_checkpoint_function",
           "tensor_version", "written_arguments", "find_operator"]


def function_mode_stack() -> list[Any]:
    """The TorchFunctionModes pushed on this thread, innermost last (a copy: changing it changes nothing)."""
    return list(torch.overrides._get_current_function_mode_stack())


def in_backward_pass() -> bool:
    """True while the autograd engine runs a backward pass on this thread (in a hook, a custom backward, or the
    recompute of a reentrant checkpoint); False in the forward pass."""
    return torch._C._current_graph_task_id() != -1


def disable_torch_function() -> contextlib.AbstractContextManager[Any]:
    """A context: within it, neither TorchFunctionModes nor tensor subclasses' ``__torch_function__`` see torch
    calls, so the agent's own copies are not captured as API calls. torch's own context object, not a generator
    around it: it is entered for every parameter's gradient a backward record copies (2.6 us less each)."""
    manager: contextlib.AbstractContextManager[Any] = torch._C.DisableTorchFunction()
    return manager


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run `callback` once when the current backward pass has finished (after every hook of that pass). Call it from
    a hook during backward; outside a backward pass it raises RuntimeError."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def op_overload_name(func: Any) -> tuple[str, str] | None:
    """(namespace, operator) of a `torch.ops` callable: ``torch.ops.aten.add.Tensor`` (an overload) and
    ``torch.ops.aten.add`` (a packet) are both ("aten", "add"); None for anything that is not an operator."""
    if isinstance(func, torch._ops.OpOverload):
        return func.namespace, func._schema.name.split("::", 1)[-1]
    if isinstance(func, torch._ops.OpOverloadPacket):
        # a packet has no `namespace` (its __getattr__ looks the name up as an overload and raises)
        ns, _, op = func._qualified_op_name.partition("::")
        return ns, op
    return None


def tensor_base_class() -> type:
    """The C class that defines Tensor's built-in methods (their ``__objclass__``): ``torch._C.TensorBase``."""
    return torch._C.TensorBase


def dispatcher_op_names() -> list[str]:
    """Every operator registered with the dispatcher, as ``namespace::name`` or ``namespace::name.overload``."""
    return list(torch._C._dispatch_get_all_op_names())


def reentrant_checkpoint_function() -> Any:
    """The autograd Function behind ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``. Its
    ``forward(ctx, run_function, preserve_rng_state, *args)`` is what the agent wraps to see the region."""
    return torch.utils.checkpoint.CheckpointFunction


# tensor_version(t): Tensor._version, a counter that every in-place write to the tensor bumps (views share their
# base's counter).
# An attrgetter, not a def: it runs for every tensor the agent holds, and a C-level getter costs no Python frame.
tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


def written_arguments(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """(positions, names) of the arguments a `torch.ops` operator's schema marks as written (``Tensor(a!) x``,
    ``Tensor(a!)[] xs``, ``*, Tensor(a!) out``); for a packet, the union over its overloads. A keyword-only argument
    has a name and no position. None when `func` is not an operator or writes none of its arguments."""
    if isinstance(func, torch._ops.OpOverload):
        schemas = [func._schema]
    elif isinstance(func, torch._ops.OpOverloadPacket):
        schemas = [getattr(func, name)._schema for name in func.overloads()]
    else:
        return None
    positions: set[int] = set()
    names: set[str] = set()
    for schema in schemas:
        for i, arg in enumerate(schema.arguments):
            alias = arg.alias_info
            if alias is not None and alias.is_write:
                names.add(arg.name)
                if not arg.kwarg_only:
                    positions.add(i)
    if not names:
        return None
    return tuple(sorted(positions)), tuple(sorted(names))


def find_operator(namespace: str, name: str) -> Any:
    """The packet ``torch.ops.<namespace>.<name>``, or None where no such operator is registered (torch_npu's
    Python functions are bound to the ``npu`` operators of the same name)."""
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None
