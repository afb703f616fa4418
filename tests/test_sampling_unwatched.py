"""Steps the agent does not watch (issue 25, goal 3: a step with nothing to capture costs next to nothing): with the
step and coverage policies, the capture mode is pushed only in the steps that can capture something known (and in
the pseudo-random probes); the records of the steps watched are those the sampler would have made anyway."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from npu_agent import PrecisionDebugger
from npu_agent.sampling import PROBE, Policy, Sampler, probe
from protos.torch_compat import function_mode_stack
from tests.support import ListSink, agent_config, free_port


def test_period_of_the_policies():
    assert Policy().period == 1
    assert Policy(coverage_steps=4).period == 4
    assert Policy(coverage_steps=1).period == 1
    assert Policy(sample_steps=3).period == 3
    assert Policy(sample_steps=4, coverage_steps=2).period == 4    # every sampled step has everything due
    assert Policy(sample_steps=4, coverage_steps=6).period == 8    # due again at the second sampled step
    assert Policy(sample_ranks=4).period == 1                      # the rank rotation alone: every step
    assert Policy(coverage_steps=4, overhead_budget=0.1).period == 1   # the budget: every step


def test_probes_are_deterministic_about_one_in_probe_and_not_periodic():
    steps = range(80000)
    hits = [s for s in steps if probe(s)]
    assert abs(len(hits) / len(steps) - 1 / PROBE) < 0.01
    assert [probe(s) for s in steps] == [probe(s) for s in steps]
    for period in (2, 3, 4, 5, 10, 100):   # each residue of a period gets its probes
        assert len({s % period for s in hits}) == period


def _debugger(tmp_path, **policy) -> tuple[PrecisionDebugger, ListSink]:
    # no server: the records are taken from the capturer (nothing reaches the sender)
    cfg = agent_config(os.path.join(str(tmp_path), "agent.json"), port=free_port(), online_connect_timeout_s=1,
                       online_close_timeout_s=1, **policy)
    dbg = PrecisionDebugger(config_path=cfg)
    assert dbg._ensure_started() and dbg._capturer is not None
    sink = ListSink()
    dbg._capturer.sink = sink.append   # the records, not the folder's files
    assert dbg._capturer.backward is not None
    dbg._capturer.backward.sink = sink.append
    return dbg, sink


def test_coverage_watches_the_steps_with_something_due_and_the_probes(tmp_path):
    dbg, sink = _debugger(tmp_path, online_coverage_steps=4)
    w = torch.randn(8, 8, requires_grad=True)
    watched, pushed = [], []
    try:
        for step in range(24):
            watched.append(dbg._capturer.sampler.watched)
            x = torch.randn(4, 8)
            dbg.start()
            pushed.append(dbg._mode in function_mode_stack())
            y = F.relu(F.linear(x, w))
            if step >= 6:   # a call site met first in a step not watched: captured at the next watched one
                y = y * 2.0
            y.sum().backward()
            dbg.stop()
            assert not function_mode_stack()
            w.grad = None
            dbg.step()
        counts = dbg._capturer.sampler.report()
    finally:
        dbg.close()
    expected = [s % 4 == 0 or probe(s) for s in range(24)]
    assert watched == pushed == expected
    assert counts["steps_unwatched"] == expected.count(False) > 0
    forward = [(r.step, r.name) for r in sink if not r.name.endswith(".backward")]
    steps = sorted({s for s, _ in forward})
    assert all(expected[s] for s in steps)
    assert {n for s, n in forward if s == 0} == {"Functional.linear.0", "Functional.relu.0", "Tensor.sum.0"}
    assert not expected[6] and not expected[7] and expected[8]
    assert [s for s, n in forward if n.startswith("Tensor.mul")][:1] == [8]
    # each watched step %4 == 0 captures the known call sites again (all due)
    for s in range(4, 24, 4):
        assert {"Functional.linear.0", "Functional.relu.0", "Tensor.sum.0"} <= {n for t, n in forward if t == s}


def _budget_run(single_process: bool, steps: int = 120, calls: int = 96, sites: int = 24, capture: float = 0.4e-3):
    """A training of `calls` calls of 1 ms a step under a 10 % budget on a fake clock; the calls of a step not
    watched are not shown to the sampler (the mode is not pushed). Returns the sampler, the steps watched and
    (training time, agent time) at each step's end."""
    now, thread = [0.0], [0.0]
    sampler = Sampler(Policy(overhead_budget=0.1), clock=lambda: now[0], thread_clock=lambda: thread[0])
    sampler.single_process = single_process
    sampler.take_step(0)
    watched, history, train, agent = [], [], 0.0, 0.0
    for step in range(steps):
        watched.append(sampler.watched)
        if not sampler.watched:
            # nothing known is left to capture in it: every call site met was captured, the step is not taken
            assert len(sampler.seen) == len(sampler.last) and not sampler.step_taken
        for i in range(calls):
            now[0] += 1e-3
            thread[0] += 1e-3
            train += 1e-3
            if sampler.watched and sampler.take(("Functional", f"api{i % sites}", (), True)):
                now[0] += capture
                thread[0] += capture
                agent += capture
        history.append((train, agent))
        sampler.take_step(step + 1)
    return sampler, watched, history


def test_overhead_budget_leaves_steps_unwatched_in_a_single_process_only():
    sampler, watched, history = _budget_run(single_process=True)
    c = sampler.report()
    assert c["new_call_sites"] == c["call_sites"] == 24 and c["steps_taken"] >= 3
    assert watched[0] and 0 < watched.count(True) < len(watched) // 2, watched
    for train, agent in history:   # the budget holds from the first step on
        assert agent <= 0.1 * train + 0.4e-3, (train, agent)
    # several ranks (or a collective met): every step is watched, the decisions are those of before
    _, every, _ = _budget_run(single_process=False)
    assert all(every)


def test_every_step_is_watched_until_a_first_call_site_is_met():
    sampler = Sampler(Policy(coverage_steps=4))
    for step in (1, 2, 3, 6, 7):   # no probes, not on the period: watched all the same while nothing is known
        assert not probe(step)
        sampler.take_step(step)
        assert sampler.watched
    sampler.take(("Functional", "linear", (), True))
    sampler.take_step(9)
    assert not sampler.watched and not probe(9)
    sampler.take_step(12)
    assert sampler.watched
