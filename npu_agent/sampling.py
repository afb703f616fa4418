"""Which calls a rank captures when checking everything costs too much (README, agent keys `online_sample_*`).

A call site is (API, input shapes and dtypes, direction): the direction is forward only, or forward and backward
when the call runs under grad mode (its backward record follows its forward). The policies, all optional:

- `online_sample_steps` N: steps with `step % N == 0` are sampled;
- `online_sample_ranks` M: of the sampled steps, rank r takes those with `(step // N + r) % M == 0`, so 1/M of
  the ranks capture at any sampled step, in turn;
- `online_coverage_steps` K: in a step the rank takes, a call site captured within the last K steps is a repeat
  and is skipped (K = 1: each call site once a step);
- `online_overhead_budget` B: what capturing costs stays under B of the training's own time (B = 0.05: 5 %),
  from the first step on (below, "The overhead budget").

Whatever the policies, a call site this rank has never captured is captured at its first occurrence (with a
budget: at its first occurrence the budget can pay for): every rank's distinct call sites are checked at least
once, then sampled. Every decision depends only on the step, the rank and the calls in order, except the budget's,
which depends on the times measured (the schedule it picks is a deterministic function of them). Counts of every
decision are kept for the end-of-run report.

The overhead budget. The training earns B times its own time: each step's wall-clock time, less the agent's CPU
outside the training thread during it (as if it ran on the training's core) and less its captured calls' estimated
cost. A step earns for at most 3 typical steps (the median step that captured nothing; before one, the lower median
of recent steps): a pause, an evaluation, earns no more. The first step, which may hold the start-up, a compile or a
data loader's first batches, earns once the second ended, for at most 3 times that one. Capturing spends: per
captured call, the training thread's time (estimated: the training thread's extra CPU in recent steps that
captured at least 32 calls between them, per call, over the median step that captured nothing; 0.5 ms until
measured), and the agent's CPU outside the training thread as the
senders measure it (`agent_cpu`: their threads' CPU clocks; the records not yet sent at the CPU per record so far).
A call is captured only while what was earned, this step's time so far included, pays for it, so the first step is
never captured whole: its call sites are spread over the first steps as the budget allows. A step is taken whole
(every call, subject to coverage) when the budget left pays for what the last step taken whole captured (before
one, every call of the previous step), and cut short if the budget runs out within it. What the budget does not
govern: the mode's own cost on every call, captured or not (bench/overhead.py --per-call, "the no-op mode" and the
sampler's skip), which the agent adds whenever it watches a step (below: in a training of one process, the steps
watched are few).

Steps the agent does not watch. Without a budget, when the step and coverage policies leave nothing known to capture
in a step, the capture mode is not pushed for it at all (PrecisionDebugger.start()), so such a step costs what the
training costs without the checker: with `online_sample_steps` N and `online_coverage_steps` K the steps watched are
those with `step % P == 0`, P = N * ceil(K / N) (P = N without coverage; a call site captured in one of them is due
again at the next; before that, every step until a first call site is met), and besides them a deterministic
pseudo-random 1 in `PROBE` of the others (the probes: a call site met only in a pattern of steps off the period, an
evaluation every 100 steps, is still met). A call site first met in a step not watched is captured at its first
occurrence in a watched one; coverage "within K steps" becomes "at the first watched step K or more steps later".
The steps watched depend only on the step and the policy, never on the rank, shapes or time: every rank watches the
same steps, as collectives need. The rank rotation alone (`online_sample_ranks`, N = 1, no coverage) watches every
step. The overhead budget, in a training of one process only (its decisions differ between ranks) and until a
collective is met, watches the steps it takes, those where a call site met was never captured yet (the budget did
not pay for it), and the probes: the mode's own cost in a taken step is then part of what the budget measures per
captured call (the training thread's extra CPU over the median step capturing nothing, most of them not watched).
The calls of a step not watched are not seen, hence not counted; `steps_unwatched` counts those steps.

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

# (category, api, (shape, dtype, shape, dtype, ...) of the input tensors, grad enabled): calls alike for coverage
CallSite = tuple[str, str, tuple[torch.Size | torch.dtype, ...], bool]
# a collective's call site: (api, process group, reduce op); p2p: ("p2p", "source->destination", "")
CollectiveSite = tuple[str, str, str]
# the agent's CPU outside the training thread: (seconds so far, records submitted, records the sender has sent)
AgentCpu = Callable[[], tuple[float, int, int]]

# The budget's estimates before anything is measured: the training thread's time per captured call, and the
# agent's other threads' CPU per record (the sender's encoding and gRPC: 0.3-0.7 ms measured on the 2-core machine).
CALL_COST_PRIOR = 0.5e-3
RECORD_CPU_PRIOR = 0.5e-3
EARN_CAP_STEPS = 3.0   # a step earns budget for at most 3 typical steps (`Sampler._typical`)
MEASURE_CALLS = 32     # the cost per captured call is measured over recent steps that captured this many calls
PROBE = 8              # of the steps with nothing known to capture, 1 in PROBE is watched all the same


def probe(step: int) -> bool:
    """A deterministic pseudo-random 1 in PROBE of the steps (Knuth's multiplicative hash of the step): not a
    fixed period, so a call site met only in a periodic pattern of steps (evaluation every 100 steps) is met too."""
    return ((step * 2654435761) & 0xFFFFFFFF) >> 29 == 0


@dataclasses.dataclass(frozen=True)
class Policy:
    sample_steps: int = 1
    sample_ranks: int = 1
    coverage_steps: int = 0
    overhead_budget: float = 0.0

    @property
    def active(self) -> bool:
        return self.sample_steps > 1 or self.sample_ranks > 1 or self.coverage_steps > 0 or self.overhead_budget > 0

    @property
    def period(self) -> int:
        """The steps watched are those with `step % period == 0` (and the probes); 1: every step is watched (the
        module docstring, "Steps the agent does not watch")."""
        if self.overhead_budget > 0:
            return 1
        n, k = self.sample_steps, self.coverage_steps
        return n * max(1, -(-k // n))


class Sampler:
    """Per-rank sampling state. `take_step(step)` at each step boundary; `take(site)` for every call."""

    def __init__(self, policy: Policy, rank: int = 0, clock: Callable[[], float] = time.perf_counter,
                 agent_cpu: AgentCpu | None = None, thread_clock: Callable[[], float] = time.thread_time):
        self.policy = policy
        self.clock = clock
        self.thread_clock = thread_clock   # the training thread's CPU (the budget's cost per captured call)
        self.rank = rank
        self.step = 0
        self.step_taken = True
        self.watched = True                          # this step is watched (the capture mode pushed for it)
        self._period = policy.period
        # the budget leaves steps unwatched only in a training of one process (PrecisionDebugger sets it): its
        # decisions differ between ranks, and every rank must watch the steps of a collective alike
        self.single_process = False
        self.last: dict[CallSite, int] = {}          # call site -> last step it was captured
        self.seen: set[CallSite] = set()             # call sites met (captured or not)
        self.collective_last: dict[CollectiveSite, int] = {}   # collective call site -> last step it was captured
        self._counts = {"calls": 0, "captured": 0, "new_call_sites": 0, "skipped_steps": 0, "skipped_ranks": 0,
                       "skipped_repeats": 0, "skipped_budget": 0, "steps_taken": 0, "steps_skipped_budget": 0,
                       "steps_unwatched": 0}
        # the compiled skip path (npu_agent.fastskip) counts the calls it skips on its side; this adds them here
        self.flush_skipped: Callable[[], None] | None = None
        # step times (s) measured with capture and without, as moving medians (reported)
        self._t_step = clock()
        self._t_on: float | None = None
        self._t_off: float | None = None
        self._on: collections.deque[float] = collections.deque(maxlen=9)
        self._off: collections.deque[float] = collections.deque(maxlen=9)
        self._reason = "skipped_steps"
        self._coverage = policy.coverage_steps
        # the budget (module docstring, "The overhead budget"): what the agent spent and the training earned, in s
        self._budget = policy.overhead_budget
        self.agent_cpu = agent_cpu
        self._call_cost = CALL_COST_PRIOR     # the training thread's time per captured call (estimated)
        # (the training thread's CPU a step took beyond a step capturing nothing, calls it captured), recent steps
        self._call_costs: collections.deque[tuple[float, int]] = collections.deque(maxlen=16)
        self._bases: collections.deque[float] = collections.deque(maxlen=9)
        self._base: float | None = None       # the median time of a step that captured nothing, less agent CPU
        self._owns: collections.deque[float] = collections.deque(maxlen=9)   # the training's own time, recent steps
        self._first_own: float | None = None  # the first step's, until the second ended (it earns no more than 3 x it)
        self._typical_own: float | None = None   # `_typical()` as the last step's end left it (read on each call)
        self._cpu_bases: collections.deque[float] = collections.deque(maxlen=9)
        self._cpu_base: float | None = None   # the median training thread CPU of a step that captured nothing
        self._thread_step = thread_clock() if policy.overhead_budget else 0.0   # that CPU when this step began
        self._earned = 0.0                    # the budget times the training's own time in the steps ended
        self._n = 0                           # calls captured under the budget so far
        self._n_step = 0                      # of them, in this step
        self._n_full: int | None = None       # calls captured in the last step taken whole
        self._full = False                    # this step is taken whole (not cut short by the budget)
        self._calls_at_step = 0               # counts["calls"] when this step began
        self._calls_prev = 0                  # calls in the previous step
        self._cpu_step = 0.0                  # the agent's other threads' CPU when this step began

    # -- step boundary ---------------------------------------------------------------------------------------
    @property
    def counts(self) -> dict[str, int]:
        """What the sampler decided so far (calls, captured, skipped by reason, steps), the compiled path's skips
        included."""
        if self.flush_skipped is not None:
            self.flush_skipped()
        return self._counts

    def take_step(self, step: int) -> bool:
        """Called at each step boundary (before the step's calls): is this step taken by the step, rank and
        budget policies? Measures the step that just ended for the budget."""
        now = self.clock()
        if step != self.step:
            self._measure(now - self._t_step)
            if self._budget:
                self._end_step(now)
        self._t_step = now
        self.step = step
        p = self.policy
        taken = step % p.sample_steps == 0
        reason = "skipped_steps"
        if taken and (step // p.sample_steps + self.rank) % p.sample_ranks != 0:
            taken, reason = False, "skipped_ranks"
        if taken and self._budget and not self._budget_allows():
            taken, reason = False, "skipped_budget"
            if not self._counts["steps_skipped_budget"]:
                _, cost = self._credit(now)
                log.info("online check: step %d and others are not captured to keep the checker under its overhead "
                         "budget (%g of the training's time; a captured call costs about %.2f ms, training thread "
                         "and sender together); call sites never seen are captured as the budget allows, and the "
                         "counts are reported at close()", step, p.overhead_budget, cost * 1e3)
            self._counts["steps_skipped_budget"] += 1
        self.step_taken = self._full = taken
        self._reason = reason
        if taken:
            self._counts["steps_taken"] += 1
        if not self.seen and not self.collective_last:   # nothing met yet: every call site is new
            self.watched = True
        elif self._budget:
            # nothing to capture unless the step is taken, a call site met was never captured (the budget did not
            # pay for it yet), or a collective was met (every rank must watch the steps of a collective alike)
            self.watched = (taken or not self.single_process or len(self.seen) > len(self.last)
                            or bool(self.collective_last) or probe(step))
        else:
            self.watched = self._period == 1 or step % self._period == 0 or probe(step)
        return taken

    def unwatched(self) -> None:
        """PrecisionDebugger.start() did not push the capture mode for this step (`watched` false): counted."""
        self._counts["steps_unwatched"] += 1

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

    # -- the overhead budget ----------------------------------------------------------------------------------
    def _agent(self) -> tuple[float, int, int]:
        return self.agent_cpu() if self.agent_cpu is not None else (0.0, 0, 0)

    def _end_step(self, now: float) -> None:
        """The step that just ended: its own time earns budget; it measures a step without capture (base) or the
        training thread's time per captured call. The agent's other threads' CPU during the step is taken out of
        its time, as if it ran on the training's core (it may: then it lengthened the step)."""
        cpu = self._agent()[0]
        thread = self.thread_clock()
        n = self._n_step
        work = now - self._t_step - (cpu - self._cpu_step)
        step_cpu = thread - self._thread_step
        self._thread_step = thread
        first = not self._owns
        if n == 0 and not first:   # the first step is no sample of a step: start-up, a compile, a data loader
            self._bases.append(work)
            self._base = statistics.median(self._bases)
            self._cpu_bases.append(step_cpu)
            self._cpu_base = statistics.median(self._cpu_bases)
        elif self._cpu_base is not None:
            # the training thread's own CPU (not the wall clock: other work on the machine does not count), as a
            # ratio of sums over recent steps: a step that captured a few calls is mostly noise on its own
            self._call_costs.append((max(step_cpu - self._cpu_base, 0.0), n))
            calls = sum(k for _, k in self._call_costs)
            if calls >= MEASURE_CALLS:
                self._call_cost = sum(extra for extra, _ in self._call_costs) / calls
        own = max(work - n * self._call_cost, 0.0)
        typical = self._typical()
        if typical is not None:   # a pause between steps (evaluation, a checkpoint save) earns no more
            own = min(own, EARN_CAP_STEPS * typical)
        if first:   # nothing to compare it with yet: it earns once the second step ended, at most 3 times that one
            self._first_own = own
        else:
            if self._first_own is not None:
                self._earned += self._budget * min(self._first_own, EARN_CAP_STEPS * own)
                self._first_own = None
            self._earned += self._budget * own
        self._owns.append(own)
        self._typical_own = self._typical()
        if self._full:
            self._n_full = n
        calls = self.counts["calls"]
        if calls != self._calls_at_step:   # a step not watched counts no calls: the last watched one stands
            self._calls_prev = calls - self._calls_at_step
        self._calls_at_step = calls
        self._n_step = 0
        self._cpu_step = cpu

    def _typical(self) -> float | None:
        """The training's own time in a step, as far as known: the median step that captured nothing, else the
        lower median of recent steps (their captures' estimated cost taken out); None before a step ended."""
        if self._base is not None:
            return self._base
        return statistics.median_low(self._owns) if self._owns else None

    def _credit(self, now: float) -> tuple[float, float]:
        """(the budget left now, the estimated cost of one more captured call), in seconds: the budget times the
        training's own time so far (this step's too), less the training thread's time for the calls captured
        (estimated per call) and the agent's other threads' CPU (measured; its records not yet sent at the cost
        per record measured so far)."""
        cpu, submitted, done = self._agent()
        per_record = cpu / done if done else RECORD_CPU_PRIOR
        in_step = max(now - self._t_step - self._n_step * self._call_cost - (cpu - self._cpu_step), 0.0)
        typical = self._typical_own   # (it changes only at a step's end)
        if typical is not None:
            in_step = min(in_step, EARN_CAP_STEPS * typical)
        earned = self._earned + self._budget * in_step
        sender = cpu + max(submitted - done, 0) * per_record if self.agent_cpu is not None else 0.0
        spent = self._n * self._call_cost + sender
        cost = self._call_cost
        if self.agent_cpu is not None:   # each captured call's records (its forward, its backward) go out
            cost += per_record * (max(submitted / self._n, 1.0) if self._n else 1.0)
        return earned - spent, cost

    def _afford(self) -> bool:
        """Is there budget left for one more captured call now? If so it is charged."""
        credit, cost = self._credit(self.clock())
        if credit < cost:
            return False
        self._n += 1
        self._n_step += 1
        return True

    def _budget_allows(self) -> bool:
        """Take a step whole when the budget left pays for what the last such step captured (before one was
        taken: every call of the previous step). The first step is never taken whole: nothing is known of it."""
        if not self._calls_prev:
            return False
        credit, cost = self._credit(self.clock())
        n = self._n_full if self._n_full is not None else self._calls_prev
        return credit >= n * cost

    def _cut(self) -> bool:
        """In a step taken whole, the budget ran out: the rest of the step is not captured."""
        self.step_taken = self._full = False
        self._reason = "skipped_budget"
        self._counts["skipped_budget"] += 1
        return False

    # -- each call ---------------------------------------------------------------------------------------------
    def take(self, site: CallSite) -> bool:
        c = self._counts
        c["calls"] += 1
        last = self.last.get(site)
        if last is None:
            self.seen.add(site)
            if self._budget and not self._afford():   # captured at a later call, when the budget allows
                c["skipped_budget"] += 1
                return False
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
        if self._budget and not self._afford():
            return self._cut()
        self.last[site] = self.step
        c["captured"] += 1
        return True

    def take_call(self, category: str, api: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                  grad_enabled: bool) -> bool:
        """`take(call_site(...))`: the capture mode asks it for every call it may record (npu_agent/_fastskip.c
        answers the calls it skips before they get here, where built)."""
        return self.take((category, api, _signature(args, kwargs), grad_enabled))

    def take_collective(self, site: CollectiveSite) -> bool:
        """A collective's decision: the same on every rank of its group (only the step and the call site count)."""
        c = self._counts
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
        if self._budget:   # what the budget charged: the agent's other threads' CPU, the estimated cost of a call
            cpu = self._agent()[0]
            out["agent_cpu_us"] = int(cpu * 1e6)
            out["call_cost_us"] = int(self._call_cost * 1e6)
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


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> tuple[torch.Size | torch.dtype, ...]:
    """Shape and dtype of each tensor argument in order, of the tensors in a list or tuple argument, and of tensor
    keyword arguments: one flat tuple (shape, dtype, shape, dtype, ...), cheaper to build and to hash than pairs
    (npu_agent/_fastskip.c builds the same tuple)."""
    kinds = _KIND_OF
    sig: list[torch.Size | torch.dtype] = []
    for v in args:
        kind = kinds.get(type(v))
        if kind is None:
            kind = _kind(type(v))
        if kind == 1:
            sig += (v.shape, v.dtype)
        elif kind == 2:
            for t in v:
                if isinstance(t, _Tensor):
                    sig += (t.shape, t.dtype)
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, _Tensor):
                sig += (v.shape, v.dtype)
    return tuple(sig)
