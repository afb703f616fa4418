"""Backward records per API call (docs/design.md §4): taps on inputs, hooks on outputs, checkpoint recomputes.

For a call under grad mode, each differentiable input is passed to the API through a private `view_as` alias with
a pre-hook on its autograd node: the alias is this call's own edge to the tensor, so its gradient is exactly this
call's grad_input, also when the tensor is used elsewhere (residuals, tied weights). One pre-hook on each output's
node gives grad_output. Hooks hold the gradients by reference (a parameter's gradient is copied: it may become the
parameter's .grad, which later code changes in place); they never return a tensor, so no gradient is replaced.

A backward record is emitted when every tapped input got its gradient, or at the end of the backward pass (an
engine callback) with what arrived. Calls whose outputs never got a gradient are closed at the step boundary
with an empty backward record, so the server can finish their result rows.

Reentrant activation checkpointing runs the region's forward under no_grad and recomputes it inside backward,
where the capture mode is not active. `install_checkpoint_support()` wraps the region function so that the first
pass holds its forward records and the recompute re-enters the mode with the same names, installing the taps that
the real graph uses. Non-reentrant checkpointing keeps the taps of the first pass and needs nothing.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from npu_agent.records import BACKWARD, PendingRecord
from npu_agent.snapshot import Snapshot, grads_snapshot, iter_tensors, map_tensors
from protos.torch_compat import disable_torch_function, queue_backward_callback

if TYPE_CHECKING:
    from npu_agent.capture import CallContext


@dataclasses.dataclass
class _Entry:
    name: str
    step: int
    positions: list[int]                 # flattened input position of each tapped slot
    grad_in: list[Any]
    grad_out: list[Any] = dataclasses.field(default_factory=list)
    leaf: list[bool] = dataclasses.field(default_factory=list)   # per slot: the input is a leaf (a parameter)
    left: int = 0
    emitted: bool = False
    module: str = ""                     # where the forward call was made (npu_agent.location)
    source: str = ""


def _copy(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    with disable_torch_function():
        return grad.detach().clone()


def _hold(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient on its way through the graph, held by reference (the same tensor object, so that its use count
    shows our reference): the engine accumulates in place, and AccumulateGrad adopts a gradient as a parameter's
    .grad without a copy, only when it holds the last reference."""
    return grad


def _map_flat(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """map_tensors for the common case of a tuple/list of leaves (fn sees every leaf and keeps non-tensors)."""
    tp = type(obj)
    if tp is tuple or tp is list:
        for v in obj:
            if isinstance(v, (tuple, list, dict, slice)):
                return map_tensors(obj, fn)
        items = [fn(v) for v in obj]
        return items if tp is list else tuple(items)
    if isinstance(obj, (tuple, list, dict, slice)):
        return map_tensors(obj, fn)
    return fn(obj)


class BackwardTaps:
    def __init__(self, sink: Callable[[PendingRecord], object]):
        self.sink = sink
        self._pending: dict[tuple[int, str], _Entry] = {}
        self._lock = threading.Lock()
        self._flush_queued = False

    # -- forward side (training thread, inside the capture mode's handler) ---------------------------------
    def tap_inputs(self, ctx: CallContext) -> None:
        """Replace each differentiable input by a hooked alias; remember the slots on `ctx.taps`."""
        rec = ctx.record
        if not ctx.recompute and rec.inputs is not None and not rec.inputs.requires_grad:
            return   # no input requires grad: nothing to tap, no walk
        first = ctx.args[0] if ctx.args and isinstance(ctx.args[0], torch.Tensor) else None
        entry = _Entry(rec.name, rec.step, [], [], module=rec.module, source=rec.source)
        position = -1
        aliases: dict[int, torch.Tensor] = {}

        def tap(t: Any) -> Any:
            nonlocal position
            if not isinstance(t, torch.Tensor):
                return t
            position += 1
            if not (t.requires_grad and (t.is_floating_point() or t.is_complex())):
                return t
            slot = len(entry.positions)
            if rec.inplace and t is first:
                # `self` of an in-place op must be mutated itself; a hook registered before the op sees the
                # gradient with respect to the value the op read. A leaf cannot be modified in place anyway.
                if t.is_leaf:
                    return t
                entry.positions.append(position)
                entry.grad_in.append(None)
                entry.leaf.append(False)
                t.register_hook(self._in_hook(entry, slot))
                return t
            alias = t.view_as(t)
            node = alias.grad_fn
            if node is None:   # grad mode off (view_as records no node): nothing to tap
                return t
            node.register_prehook(self._in_hook(entry, slot, pre=True))
            entry.positions.append(position)
            entry.grad_in.append(None)
            entry.leaf.append(t.is_leaf)
            aliases[id(alias)] = t
            return alias

        args = _map_flat(ctx.args, tap)
        kwargs = {k: _map_flat(v, tap) for k, v in ctx.kwargs.items()} if ctx.kwargs else ctx.kwargs
        if entry.positions:
            entry.left = len(entry.positions)
            ctx.args, ctx.kwargs = args, kwargs
            ctx.taps = (entry, aliases)

    def tap_outputs(self, ctx: CallContext, out: Any) -> Any:
        """Hook every differentiable output; give back the original tensor where the API returned our alias."""
        entry, aliases = ctx.taps
        if aliases:
            out = map_tensors(out, lambda t: aliases.get(id(t), t))
        outs = [out] if isinstance(out, torch.Tensor) else list(iter_tensors(out))
        entry.grad_out = [None] * len(outs)
        # one pre-hook per autograd node, for all its outputs we return: id(node) -> (node, [(output_nr, j)])
        nodes: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for j, o in enumerate(outs):
            fn = o.grad_fn
            if fn is not None and o.requires_grad:
                nodes.setdefault(id(fn), (fn, []))[1].append((o.output_nr, j))
        for fn, slots in nodes.values():
            fn.register_prehook(self._out_hook(entry, slots))
        if nodes:
            ctx.record.backward_expected = True
            with self._lock:
                self._pending[(entry.step, entry.name)] = entry
        return out

    # -- backward side (autograd engine threads) ------------------------------------------------------------
    def _out_hook(self, entry: _Entry, slots: list[tuple[int, int]]) -> Callable[[tuple[Any, ...]], None]:
        def hook(grads: tuple[Any, ...]) -> None:
            with self._lock:
                if not entry.emitted:
                    for nr, j in slots:
                        if entry.grad_out[j] is None and nr < len(grads):
                            entry.grad_out[j] = _hold(grads[nr])
            return None
        return hook

    def _in_hook(self, entry: _Entry, slot: int, pre: bool = False) -> Callable[[Any], None]:
        """The hook for one tapped input: a tensor hook (grad) or, with `pre`, a pre-hook on the alias's node
        (a tuple holding grad)."""
        def hook(grad: Any) -> None:
            if pre:
                grad = grad[0]
            emit = False
            with self._lock:
                if entry.emitted or entry.grad_in[slot] is not None:
                    return None  # retain_graph double backward: the first gradient is the record
                # A parameter's gradient may become its .grad without a copy (AccumulateGrad steals a view of
                # it), which later steps, clipping or zero_grad change in place: copied now.
                entry.grad_in[slot] = _copy(grad) if entry.leaf[slot] else _hold(grad)
                entry.left -= 1
                if entry.left == 0:
                    emit = self._take(entry)
                queue = not self._flush_queued
                self._flush_queued = True
            if emit:
                self._emit(entry)
            if queue:
                try:
                    queue_backward_callback(self._end_of_backward)
                except RuntimeError:
                    with self._lock:
                        self._flush_queued = False
            return None
        return hook

    def _take(self, entry: _Entry) -> bool:
        """Under the lock: mark the entry emitted; True if this caller must emit it."""
        if entry.emitted:
            return False
        entry.emitted = True
        self._pending.pop((entry.step, entry.name), None)
        return True

    def _end_of_backward(self) -> None:
        """After a backward pass: emit the calls that got some, but not all, of their gradients."""
        with self._lock:
            self._flush_queued = False
            ready = [e for e in list(self._pending.values()) if any(g is not None for g in e.grad_in) and self._take(e)]
        for e in ready:
            self._emit(e)

    def _emit(self, entry: _Entry) -> None:
        rec = PendingRecord(
            name=entry.name, step=entry.step, direction=BACKWARD,
            grad_output=_snap(entry.grad_out), grad_input=_snap(entry.grad_in),
            grad_input_positions=tuple(entry.positions), grad_enabled=True, module=entry.module, source=entry.source,
        )
        self.sink(rec)

    def end_step(self) -> None:
        """Step boundary: close calls that never got a gradient (an empty backward record each)."""
        with self._lock:
            rest = [e for e in list(self._pending.values()) if self._take(e)]
        for e in rest:
            if any(g is not None for g in e.grad_in):
                self._emit(e)
            else:
                self.sink(PendingRecord(name=e.name, step=e.step, direction=BACKWARD, grad_enabled=True,
                                        grad_input=_snap([]), module=e.module, source=e.source))


def _snap(values: list[Any]) -> Snapshot:
    return grads_snapshot(values)
