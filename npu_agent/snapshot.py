"""Private copies of call arguments and results, taken on the training thread.

A snapshot is the same tree (tuple/list/dict, any nesting) with every tensor replaced by `detach().clone()`:
private storage that later in-place ops cannot change, no autograd edge, no version bump. The copy stays on the
tensor's device; the sender thread moves it to the host. Nothing else is done on the training thread.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


@dataclasses.dataclass
class Snapshot:
    tree: Any
    nbytes: int
    requires_grad: set[int]  # ids of the copies whose originals required grad


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply `fn` to every tensor in a tuple/list/dict tree; other leaves are kept. Hand-written (pytree is ~10x
    slower on the hot path, reference/hooking.md §4)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        if not obj:
            return obj
        items = [map_tensors(v, fn) for v in obj]
        if isinstance(obj, list):
            return items
        return tuple(items)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(map_tensors(obj.start, fn), map_tensors(obj.stop, fn), map_tensors(obj.step, fn))
    return obj


def iter_tensors(obj: Any):
    """Every tensor in a tree, in the same order as `map_tensors` visits them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, slice):
        for v in (obj.start, obj.stop, obj.step):
            yield from iter_tensors(v)


def snapshot(obj: Any) -> Snapshot:
    total = 0
    grads: set[int] = set()

    def copy(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        c = t.detach().clone()
        total += c.numel() * c.element_size()
        if t.requires_grad:
            grads.add(id(c))
        return c

    tree = map_tensors(obj, copy)
    return Snapshot(tree, total, grads)
