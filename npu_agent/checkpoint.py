"""Reentrant activation checkpointing (`torch.utils.checkpoint(..., use_reentrant=True)`), docs/design.md §4.

The region's first pass runs under no_grad, so its calls get no taps; the graph that backward really uses is
built by the recompute inside backward, where the capture mode is not active. `install()` wraps the region
function given to `CheckpointFunction` (only while a capture mode is active on this thread):
- first pass: the region's forward records are held, with their names in call order;
- recompute: the mode is pushed again, each call gets the name of its first-pass twin, taps and hooks are installed
  but nothing is recorded a second time; then the held forward records are released, marked with whether a
  backward record follows.
Held records whose region is never recomputed are released at the step boundary.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from protos.torch_compat import function_mode_stack, in_backward_pass, reentrant_checkpoint_function

if TYPE_CHECKING:
    from npu_agent.capture import CaptureMode, Capturer
    from npu_agent.records import PendingRecord

_installed = False
_lock = threading.Lock()


def _active_mode() -> CaptureMode | None:
    from npu_agent.capture import CaptureMode

    for mode in reversed(function_mode_stack()):
        if isinstance(mode, CaptureMode):
            return mode
    return None


class Region:
    def __init__(self, fn: Callable[..., Any], mode: CaptureMode):
        self.fn = fn
        self.mode = mode
        self.names: list[str] = []
        self.held: dict[str, PendingRecord] = {}
        self.recomputing = False
        self.pos = 0
        self.released = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cap = self.mode.capturer
        if not in_backward_pass():   # the first pass, in forward
            if _active_mode() is not self.mode:
                return self.fn(*args, **kwargs)
            outer, cap.region = cap.region, self
            try:
                return self.fn(*args, **kwargs)
            finally:
                cap.region = outer
                if self.held:
                    cap.open_regions.append(self)
        if not self.held or self.released:           # nothing of this region was captured
            return self.fn(*args, **kwargs)
        outer, cap.region = cap.region, self
        self.recomputing, self.pos = True, 0
        try:
            with self.mode:
                return self.fn(*args, **kwargs)
        finally:
            self.recomputing = False
            cap.region = outer
            self.release(cap)

    def hold(self, rec: PendingRecord) -> None:
        self.names.append(rec.name)
        self.held[rec.name] = rec

    def next_name(self) -> str | None:
        if self.pos >= len(self.names):
            return None
        self.pos += 1
        return self.names[self.pos - 1]

    def release(self, cap: Capturer) -> None:
        if self.released:
            return
        self.released = True
        for name in self.names:
            cap.sink(self.held[name])
        self.held.clear()


def install() -> None:
    """Wrap CheckpointFunction.forward once per process; a no-op for calls made while no capture is active."""
    global _installed
    with _lock:
        if _installed:
            return
        fn_cls = reentrant_checkpoint_function()
        original = fn_cls.forward

        def forward(ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            mode = _active_mode()
            if mode is not None and not isinstance(run_function, Region):
                run_function = Region(run_function, mode)
            return original(ctx, run_function, preserve_rng_state, *args)

        fn_cls.forward = staticmethod(forward)   # the wrap is the point
        _installed = True
