"""Registry of reference implementations for torch_npu fused operators.

Shaped like ``torch/utils/flop_counter.py``: each operator is one small pure function registered under its bare
torch_npu name with the :func:`reference` decorator. The server looks names up with :func:`get_reference` and never
resolves operator names any other way (no ``eval``, no ``getattr`` on user strings).

Every reference takes exactly torch_npu's documented positional/keyword arguments and defaults, returns what
torch_npu returns (same tuple arity), computes in the dtype of its inputs (the server upcasts before calling) on the
inputs' device, and is written with differentiable torch ops so that the backward is autograd through it.
"""

from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["FUSED_REFERENCES", "reference", "get_reference"]

F = TypeVar("F", bound=Callable)

FUSED_REFERENCES: dict[str, Callable] = {}

_PREFIXES = ("torch_npu.", "torch.ops.npu.", "npu.")


def reference(name: str) -> Callable[[F], F]:
    """Register the decorated function as the reference of torch_npu operator ``name``."""

    def decorator(fn: F) -> F:
        if name in FUSED_REFERENCES:
            raise ValueError(f"fused reference {name!r} is already registered")
        FUSED_REFERENCES[name] = fn
        return fn

    return decorator


def get_reference(name: str) -> Callable | None:
    """The reference registered for ``name`` (bare name, optionally prefixed ``torch_npu.``), else None."""
    if not isinstance(name, str):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return FUSED_REFERENCES.get(name)
