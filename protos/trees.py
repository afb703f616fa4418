"""Walking call arguments and results: tuples, lists, dicts and slices, any nesting, in one fixed order.

Both sides use these walks, so a tensor's position in a call's flattened inputs means the same thing to the
agent (which records grad_input positions) and to the server (which replays them). Hand-written: pytree is about
ten times slower on the agent's hot path (reference/hooking.md §4).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable


def iter_leaves(obj: Any) -> Iterator[Any]:
    """Every leaf, depth first: tuple/list items in order, dict values in insertion order, slice start/stop/step."""
    if isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_leaves(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_leaves(v)
    elif isinstance(obj, slice):
        yield from iter_leaves((obj.start, obj.stop, obj.step))
    else:
        yield obj


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """The same tree with every leaf replaced by fn(leaf), visited in `iter_leaves` order. Tuples stay tuples
    (named tuples and torch.return_types become plain tuples), lists stay lists."""
    if isinstance(obj, (tuple, list)):
        if not obj:
            return obj
        items = [map_leaves(v, fn) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {k: map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(map_leaves(obj.start, fn), map_leaves(obj.stop, fn), map_leaves(obj.step, fn))
    return fn(obj)
