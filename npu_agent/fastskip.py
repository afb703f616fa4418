"""The capture mode's compiled answer for calls the sampling skips (docs/design.md §4, "Skipped calls in C").

`npu_agent/_fastskip.c` is a plain CPython extension (no torch headers): `Skipper.skip(func, args, kwargs)` either
does exactly the bookkeeping the Python path does for a call the sampling skips and returns True, or changes
nothing and returns False, and the Python path (npu_agent.capture) decides as it always has. Without the compiled
module, or with ONLINE_CHECK_PURE_PYTHON=1, the Python path answers every call: the records, the counts and the
reports are the same either way (tests/test_fastskip.py).

Built by `python -m npu_agent.compiled --build` (scripts/setup.sh runs it), which says how the agent's compiled
modules are built and loaded.
"""
from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from npu_agent.compiled import PURE_PYTHON_ENV, SKIP

if TYPE_CHECKING:
    from npu_agent.capture import Capturer

__all__ = ["PURE_PYTHON_ENV", "SKIP", "load", "skipper"]


def load() -> ModuleType | None:
    """The compiled module, or None (npu_agent.compiled: not built, ONLINE_CHECK_PURE_PYTHON=1, failed to load)."""
    return SKIP.load()


def skipper(capturer: "Capturer") -> Callable[[Any, tuple[Any, ...], dict[str, Any] | None], bool] | None:
    """`skip(func, args, kwargs)` for this capturer's calls, or None where the Python path answers alone: no
    compiled module, no sampler, or a scope or an api list (their selection comes first, in Python)."""
    sampler = capturer.sampler
    if sampler is None or capturer.scope or capturer.api_list:
        return None
    module = load()
    if module is None:
        return None
    import torch

    if type(torch.Tensor).__instancecheck__ is not type.__instancecheck__:   # is_tensor in _fastskip.c relies on it
        return None

    from npu_agent import capture, naming, sampling
    from npu_agent.snapshot import HELD

    # the Python path's own containers: mutated in place, never replaced (tests/test_fastskip.py checks it)
    s = module.Skipper(naming.CLASSIFIED, capture._KINDS, sampling._KIND_OF, torch.Tensor, HELD.pending,
                       torch.is_grad_enabled, torch._C._current_graph_task_id, capturer._writes_inputs,
                       capturer._counts, sampler, sampler.last, sampler._counts)
    sampler.flush_skipped = s.flush   # the sampler's counts of the calls skipped in C, added before they are read
    skip: Callable[[Any, tuple[Any, ...], dict[str, Any] | None], bool] = s.skip
    return skip
