"""Backward records per API call (SPEC §3.3): taps on inputs, hooks on outputs, checkpoint recomputes.

For a call under grad mode, each differentiable input is passed to the API through a private `view_as` alias with
a hook: the alias is this call's own edge to the tensor, so its gradient is exactly this call's grad_input, also
when the tensor is used elsewhere (residuals, tied weights). Hooks on the outputs give grad_output. Hooks only
copy; they never return a tensor, so no gradient is ever replaced.

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
from npu_agent.snapshot import Snapshot, iter_tensors, map_tensors

if TYPE_CHECKING:
    from npu_agent.capture import CallContext


@dataclasses.dataclass
class _Entry:
    name: str
    step: int
    positions: list[int]                 # flattened input position of each tapped slot
    grad_in: list[Any]
    grad_out: list[Any] = dataclasses.field(default_factory=list)
    left: int = 0
    emitted: bool = False


def _copy(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    with torch._C.DisableTorchFunction():
        return grad.detach().clone()


def _differentiable(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


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
        first = ctx.args[0] if ctx.args and isinstance(ctx.args[0], torch.Tensor) else None
        entry = _Entry(rec.name, rec.step, [], [])
        position = -1
        aliases: dict[int, torch.Tensor] = {}

        def tap(t: torch.Tensor) -> torch.Tensor:
            nonlocal position
            position += 1
            if not _differentiable(t):
                return t
            slot = len(entry.positions)
            if rec.inplace and t is first:
                # `self` of an in-place op must be mutated itself; a hook registered before the op sees the
                # gradient with respect to the value the op read. A leaf cannot be modified in place anyway.
                if t.is_leaf:
                    return t
                entry.positions.append(position)
                entry.grad_in.append(None)
                t.register_hook(self._in_hook(entry, slot))
                return t
            alias = t.view_as(t)
            alias.register_hook(self._in_hook(entry, slot))
            entry.positions.append(position)
            entry.grad_in.append(None)
            aliases[id(alias)] = t
            return alias

        args = map_tensors(ctx.args, tap)
        kwargs = map_tensors(ctx.kwargs, tap)
        if entry.positions:
            entry.left = len(entry.positions)
            ctx.args, ctx.kwargs = args, kwargs
            ctx.taps = (entry, aliases)

    def tap_outputs(self, ctx: CallContext, out: Any) -> Any:
        """Hook every differentiable output; give back the original tensor where the API returned our alias."""
        entry, aliases = ctx.taps
        if aliases:
            out = map_tensors(out, lambda t: aliases.get(id(t), t))
        hooked = False
        outs = list(iter_tensors(out))
        entry.grad_out = [None] * len(outs)
        for j, o in enumerate(outs):
            if o.requires_grad and o.grad_fn is not None:
                o.register_hook(self._out_hook(entry, j))
                hooked = True
        if hooked:
            ctx.record.backward_expected = True
            with self._lock:
                self._pending[(entry.step, entry.name)] = entry
        return out

    # -- backward side (autograd engine threads) ------------------------------------------------------------
    def _out_hook(self, entry: _Entry, j: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            with self._lock:
                if not entry.emitted:
                    entry.grad_out[j] = _copy(grad) if entry.grad_out[j] is None else entry.grad_out[j]
            return None
        return hook

    def _in_hook(self, entry: _Entry, slot: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            emit = False
            with self._lock:
                if entry.emitted or entry.grad_in[slot] is not None:
                    return None  # retain_graph double backward: the first gradient is the record
                entry.grad_in[slot] = _copy(grad)
                entry.left -= 1
                if entry.left == 0:
                    emit = self._take(entry)
                queue = not self._flush_queued
                self._flush_queued = True
            if emit:
                self._emit(entry)
            if queue:
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
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
            grad_input_positions=tuple(entry.positions), grad_enabled=True,
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
                                        grad_input=_snap([])))


def _snap(values: list[Any]) -> Snapshot:
    total = sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
    return Snapshot(list(values), total, set())
