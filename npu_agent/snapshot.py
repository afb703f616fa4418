"""Private copies of call arguments and results, taken on the training thread.

A snapshot is the same tree (tuple/list/dict, any nesting) with every tensor replaced by `detach().clone()`:
private storage that later in-place ops cannot change, no autograd edge, no version bump. The copy stays on the
tensor's device; the sender thread moves it to the host. Nothing else is done on the training thread.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Callable

import torch

from protos.trees import iter_leaves, map_leaves


@dataclasses.dataclass
class Snapshot:
    tree: Any
    nbytes: int
    requires_grad: set[int]  # ids of the copies whose originals required grad


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply `fn` to every tensor in a tuple/list/dict/slice tree; other leaves are kept."""
    return map_leaves(obj, lambda v: fn(v) if isinstance(v, torch.Tensor) else v)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a tree, in the order the server flattens a call's inputs (protos.trees)."""
    return (v for v in iter_leaves(obj) if isinstance(v, torch.Tensor))


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
