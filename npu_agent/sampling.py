"""Which calls a rank captures when checking everything costs too much (README, agent keys `online_sample_*`).

A call site is (API, input shapes and dtypes, direction): the direction is forward only, or forward and backward
when the call runs under grad mode (its backward record follows its forward). The policies, all optional:

- `online_sample_steps` N: steps with `step % N == 0` are sampled;
- `online_sample_ranks` M: of the sampled steps, rank r takes those with `(step // N + r) % M == 0`, so 1/M of
  the ranks capture at any sampled step, in turn;
- `online_coverage_steps` K: in a step the rank takes, a call site captured within the last K steps is a repeat
  and is skipped (K = 1: each call site once a step);
- `online_overhead_budget` B: the agent measures the training's step time with capture and without, and takes a
  step only as often as keeps the average extra time under B of the step time (B = 0.05: 5 %).

Whatever the policies, a call site this rank has never captured is captured at its first occurrence: every rank's
distinct call sites are checked at least once, then sampled. Every decision depends only on the step, the rank
and the calls in order, except the budget's, which depends on the step times measured (the schedule it picks is a
deterministic function of them). Counts of every decision are kept for the end-of-run report.

torch.distributed collectives (npu_agent.collectives) are checked across the ranks of their group, so every rank
of the group must take the same decision for the same collective: for them the decision depends only on the step
and the call site (api, process group, reduce op; p2p: the source -> destination pair), never on shapes, the rank or
time. The step policy (`online_sample_steps`) and coverage (`online_coverage_steps`) apply; the rank rotation
(`online_sample_ranks`) and the time budget (`online_overhead_budget`) do not (they differ between ranks). A
collective call site met for the first time is captured, as any other. They are counted with the other calls in
`counts` (calls, captured, new_call_sites, skipped_steps, skipped_repeats; never skipped_ranks or skipped_budget).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
from typing import Any, Callable

import torch

log = logging.getLogger("npu_agent")

# (category, api, ((shape, dtype) of each input tensor, ...), grad enabled): calls alike for coverage sampling
CallSite = tuple[str, str, tuple[tuple[torch.Size, torch.dtype], ...], bool]
# a collective's call site: (api, process group, reduce op); p2p: ("p2p", "source->destination", "")
CollectiveSite = tuple[str, str, str]


@dataclasses.dataclass(frozen=True)
class Policy:
    sample_steps: int = 1
    sample_ranks: int = 1
    coverage_steps: int = 0
    overhead_budget: float = 0.0

    @property
    def active(self) -> bool:
        return self.sample_steps > 1 or self.sample_ranks > 1 or self.coverage_steps > 0 or self.overhead_budget > 0


class Sampler:
    """Per-rank sampling state. `take_step(step)` at each step boundary; `take(site)` for every call."""

    def __init__(self, policy: Policy, rank: int = 0, clock: Callable[[], float] = time.perf_counter):
        self.policy = policy
        self.clock = clock
        self.rank = rank
        self.step = 0
        self.step_taken = True
        self.last: dict[CallSite, int] = {}          # call site -> last step it was captured
        self.seen: set[CallSite] = set()             # call sites met (captured or not)
        self.collective_last: dict[CollectiveSite, int] = {}   # collective call site -> last step it was captured
        self.counts = {"calls": 0, "captured": 0, "new_call_sites": 0, "skipped_steps": 0, "skipped_ranks": 0,
                       "skipped_repeats": 0, "skipped_budget": 0, "steps_taken": 0, "steps_skipped_budget": 0}
        # the budget: step times (s) measured with capture and without, as moving averages
        self._t_step = clock()
        self._t_on: float | None = None
        self._t_off: float | None = None
        self._on: collections.deque[float] = collections.deque(maxlen=9)
        self._off: collections.deque[float] = collections.deque(maxlen=9)
        self._budget_credit = 0.0
        self._reason = "skipped_steps"
        self._coverage = policy.coverage_steps

    # -- step boundary ---------------------------------------------------------------------------------------
    def take_step(self, step: int) -> bool:
        """Called at each step boundary (before the step's calls): is this step taken by the step, rank and
        budget policies? Measures the step that just ended for the budget."""
        now = self.clock()
        if step != self.step:
            self._measure(now - self._t_step)
        self._t_step = now
        self.step = step
        p = self.policy
        taken = step % p.sample_steps == 0
        reason = "skipped_steps"
        if taken and (step // p.sample_steps + self.rank) % p.sample_ranks != 0:
            taken, reason = False, "skipped_ranks"
        if taken and p.overhead_budget > 0 and not self._budget_allows():
            taken, reason = False, "skipped_budget"
            if not self.counts["steps_skipped_budget"]:
                log.info("online check: step %d and others are not captured to keep the checker under its overhead "
                         "budget (%g of the step time; a step takes %.1f ms captured, %.1f ms not); call sites never "
                         "seen are still captured, and the counts are reported at close()", step,
                         p.overhead_budget, (self._t_on or 0) * 1e3, (self._t_off or 0) * 1e3)
            self.counts["steps_skipped_budget"] += 1
        self.step_taken = taken
        self._reason = reason
        if taken:
            self.counts["steps_taken"] += 1
        return taken

    def _measure(self, seconds: float) -> None:
        """Step times are kept as medians of the last 9 steps of each kind: a pause between steps (evaluation, a
        checkpoint save) is one outlier, not a new estimate."""
        samples = self._on if self.step_taken else self._off
        samples.append(seconds)
        median = statistics.median(samples)
        if self.step_taken:
            self._t_on = median
        else:
            self._t_off = median

    def _budget_allows(self) -> bool:
        """Take a step when the credit earned by skipped steps pays for its measured extra time."""
        if self._t_off is None:
            return self._t_on is None   # the first step is taken; the next measures the step without capture
        if self._t_on is None:
            return True
        extra = max(self._t_on - self._t_off, 0.0)
        if extra <= self.policy.overhead_budget * self._t_off:
            return True
        # each step earns budget * step time; a taken step spends its extra time
        self._budget_credit += self.policy.overhead_budget * self._t_off
        if self._budget_credit >= extra:
            self._budget_credit -= extra
            return True
        return False

    # -- each call ---------------------------------------------------------------------------------------------
    def take(self, site: CallSite) -> bool:
        c = self.counts
        c["calls"] += 1
        last = self.last.get(site)
        if last is None:
            self.seen.add(site)
            self.last[site] = self.step
            c["new_call_sites"] += 1
            c["captured"] += 1
            return True
        if not self.step_taken:
            c[self._reason] += 1
            return False
        k = self._coverage
        if k and self.step - last < k:
            c["skipped_repeats"] += 1
            return False
        self.last[site] = self.step
        c["captured"] += 1
        return True

    def take_call(self, category: str, api: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                  grad_enabled: bool) -> bool:
        """`take(call_site(...))` in one call: the capture mode asks it for every call it may record."""
        sig: list[tuple[torch.Size, torch.dtype]] = []   # _signature, inline: this runs for every call
        kinds = _KIND_OF
        for v in args:
            kind = kinds.get(type(v))
            if kind is None:
                kind = _kind(type(v))
            if kind == 1:
                sig.append((v.shape, v.dtype))
            elif kind == 2:
                sig.extend([(t.shape, t.dtype) for t in v if isinstance(t, _Tensor)])
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, _Tensor):
                    sig.append((v.shape, v.dtype))
        site = (category, api, tuple(sig), grad_enabled)
        c = self.counts
        c["calls"] += 1
        last = self.last.get(site)
        if last is None:
            self.seen.add(site)
            self.last[site] = self.step
            c["new_call_sites"] += 1
            c["captured"] += 1
            return True
        if not self.step_taken:
            c[self._reason] += 1
            return False
        k = self._coverage
        if k and self.step - last < k:
            c["skipped_repeats"] += 1
            return False
        self.last[site] = self.step
        c["captured"] += 1
        return True

    def take_collective(self, site: CollectiveSite) -> bool:
        """A collective's decision: the same on every rank of its group (only the step and the call site count)."""
        c = self.counts
        c["calls"] += 1
        last = self.collective_last.get(site)
        if last is None:
            self.collective_last[site] = self.step
            c["new_call_sites"] += 1
            c["captured"] += 1
            return True
        if self.step % self.policy.sample_steps != 0:
            c["skipped_steps"] += 1
            return False
        k = self.policy.coverage_steps
        if k and self.step - last < k:
            c["skipped_repeats"] += 1
            return False
        self.collective_last[site] = self.step
        c["captured"] += 1
        return True

    def report(self) -> dict[str, int]:
        out = {k: v for k, v in self.counts.items()}
        out["call_sites"] = len(self.seen) + len(self.collective_last)
        if self._t_on is not None:
            out["step_us_captured"] = int(self._t_on * 1e6)
        if self._t_off is not None:
            out["step_us_not_captured"] = int(self._t_off * 1e6)
        return out


def call_site(category: str, api: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
              grad_enabled: bool) -> CallSite:
    """(API, input shapes and dtypes, direction) of a call; tensors in nested lists count too."""
    return (category, api, _signature(args, kwargs), grad_enabled)


_Tensor = torch.Tensor
# type -> 1: a tensor, 2: a list or tuple, 0: anything else. `isinstance(v, torch.Tensor)` is fast for a tensor but
# slow (~0.1 us) for an int or a float (torch.Tensor's metaclass): the kind is looked up by the argument's type.
_KIND_OF: dict[type, int] = {}


def _kind(tp: type) -> int:
    if len(_KIND_OF) > 1024:   # types made at run time: keep the table bounded
        _KIND_OF.clear()
    kind = _KIND_OF[tp] = 1 if issubclass(tp, _Tensor) else 2 if issubclass(tp, (list, tuple)) else 0
    return kind


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """(shape, dtype) of each tensor argument in order, of the tensors in a list or tuple argument, and of tensor
    keyword arguments."""
    sig: list[tuple[torch.Size, torch.dtype]] = []
    kinds = _KIND_OF
    for v in args:
        kind = kinds.get(type(v))
        if kind is None:
            kind = _kind(type(v))
        if kind == 1:
            sig.append((v.shape, v.dtype))
        elif kind == 2:
            sig.extend([(t.shape, t.dtype) for t in v if isinstance(t, _Tensor)])
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, _Tensor):
                sig.append((v.shape, v.dtype))
    return tuple(sig)
