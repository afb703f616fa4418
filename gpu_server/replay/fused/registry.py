"""Registry of reference implementations for torch_npu fused operators.

Shaped like ``torch/utils/flop_counter.py``: each operator is one small pure function registered under its bare
torch_npu name with the :func:`reference` decorator. The server looks names up with :func:`get_reference` and never
resolves operator names any other way (no ``eval``, no ``getattr`` on user strings).

The operator's extension file (gpu_server/replay/extensions.py, docs/extensions.md) registers its references here too,
with
:func:`register_extension`: a custom ``torch.library`` operator under its ``namespace::op`` name, or a fused operator
under its bare torch_npu name (replacing the built-in one); :func:`unregister_extensions` takes them back out.

Every reference takes exactly torch_npu's documented positional/keyword arguments and defaults, returns what
torch_npu returns (same tuple arity), computes in the dtype of its inputs (the server upcasts before calling) on the
inputs' device, and is written with differentiable torch ops so that the backward is autograd through it.
"""

from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["FUSED_REFERENCES", "reference", "get_reference", "register_extension", "unregister_extensions",
           "extension_names"]

F = TypeVar("F", bound=Callable)

FUSED_REFERENCES: dict[str, Callable] = {}
_BUILT_IN: dict[str, Callable] = {}      # the built-in references an extension replaced, put back by unregister
_EXTENSIONS: set[str] = set()            # names registered by the extension file

_PREFIXES = ("torch_npu.", "torch.ops.npu.", "npu.")


def reference(name: str) -> Callable[[F], F]:
    """Register the decorated function as the reference of torch_npu operator ``name``."""

    def decorator(fn: F) -> F:
        if name in FUSED_REFERENCES:
            raise ValueError(f"fused reference {name!r} is already registered")
        FUSED_REFERENCES[name] = fn
        return fn

    return decorator


def register_extension(name: str, fn: Callable) -> None:
    """Register `fn`, a reference named by the server's extension file, under ``name`` (``namespace::op`` for a
    custom operator, the bare torch_npu name for a fused one: that one replaces the built-in reference)."""
    if name in _EXTENSIONS:
        raise ValueError(f"reference {name!r} is named twice in the extension file")
    if name in FUSED_REFERENCES:
        _BUILT_IN[name] = FUSED_REFERENCES[name]
    FUSED_REFERENCES[name] = fn
    _EXTENSIONS.add(name)


def unregister_extensions() -> None:
    """Remove every reference of the extension file (the built-in ones it replaced come back)."""
    for name in list(_EXTENSIONS):
        FUSED_REFERENCES.pop(name, None)
        if name in _BUILT_IN:
            FUSED_REFERENCES[name] = _BUILT_IN.pop(name)
    _EXTENSIONS.clear()


def extension_names() -> frozenset[str]:
    return frozenset(_EXTENSIONS)


def get_reference(name: str) -> Callable | None:
    """The reference registered for ``name`` (bare name, optionally prefixed ``torch_npu.``), else None."""
    if not isinstance(name, str):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return FUSED_REFERENCES.get(name)
