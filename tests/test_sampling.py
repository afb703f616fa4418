"""Sampling policies (issue 13, goal 6): every Nth step, ranks in turn, coverage of call sites, the overhead budget;
every rank's distinct call sites are checked at least once; all decisions are counted. In-process capture for the
policies, then 8 ranks spread over 2 real servers with coverage sampling."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import torch.nn.functional as F

from gpu_server.reports.summary import Summary
from npu_agent.capture import CaptureMode, Capturer
from npu_agent.sampling import Policy, Sampler
from npu_agent.transport import Counts, StreamIdentity, end_frame
from protos import online_check_pb2 as pb
from tests.support import ListSink, Server, agent_config, read_csv, run_ranks


def _two_blocks(x, w1, w2):
    h = F.relu(F.linear(x, w1))          # the second block has the same call sites as the first
    return F.relu(F.linear(h, w2)).sum()


def _run(policy: Policy, steps: int, rank: int = 0) -> tuple[ListSink, Sampler]:
    sink = ListSink()
    sampler = Sampler(policy, rank)
    cap = Capturer(sink.append, sampler=sampler)
    cap.next_step(0)
    mode = CaptureMode(cap)
    x, w1, w2 = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)
    for step in range(steps):
        with mode:
            _two_blocks(x, w1, w2)
        cap.next_step(step + 1)
    return sink, sampler


def _by_step(sink: ListSink) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for r in sink:
        out.setdefault(r.step, []).append(r.name)
    return out


def test_coverage_checks_each_call_site_once_every_k_steps_and_skips_repeats():
    sink, sampler = _run(Policy(coverage_steps=2), steps=4)
    sites = ["Functional.linear.0", "Functional.relu.0", "Tensor.sum.0"]
    assert _by_step(sink) == {0: sites, 2: sites}
    c = sampler.report()
    assert (c["calls"], c["captured"], c["call_sites"], c["new_call_sites"], c["skipped_repeats"]) == (20, 6, 3, 3, 14)


def test_steps_and_ranks_in_turn_and_new_call_sites_always():
    # rank 1 of M=2 takes the sampled steps (every 2nd) where (step // 2 + 1) % 2 == 0: steps 2 and 6
    sink, sampler = _run(Policy(sample_steps=2, sample_ranks=2), steps=8, rank=1)
    every = ["Functional.linear.0", "Functional.relu.0", "Functional.linear.1", "Functional.relu.1", "Tensor.sum.0"]
    first_seen = ["Functional.linear.0", "Functional.relu.0", "Tensor.sum.0"]   # step 0: new call sites only
    assert _by_step(sink) == {0: first_seen, 2: every, 6: every}
    c = sampler.report()
    assert c["steps_taken"] == 2 and c["skipped_ranks"] == 2 + 5 and c["skipped_steps"] == 4 * 5
    assert c["captured"] + c["skipped_ranks"] + c["skipped_steps"] == c["calls"] == 40


def _simulate(budget: float, steps: int, capture: float = 0.4e-3, record_cpu: float = 0.5e-3, calls: int = 96,
              sites: int = 24, charge_sender: bool = True, pause_at: int = -1, lag: int = 16):
    """A training under the budget on a fake clock (no timing of this machine: every number is deterministic). Each
    step makes `calls` calls of 1 ms over `sites` call sites; a captured call costs `capture` s more in the training
    thread and one record, whose `record_cpu` s of sender CPU run on the training's core `lag` calls later (into
    the next step: they lengthen it). `charge_sender=False`: the sampler is not told the sender's CPU. Returns the
    sampler and, at each step's end, (the training's own time so far, the agent's cost so far including the CPU
    owed for records not yet sent, calls captured in the step)."""
    now, cpu, submitted, done, thread = [0.0], [0.0], [0], [0], [0.0]
    sampler = Sampler(Policy(overhead_budget=budget), clock=lambda: now[0], thread_clock=lambda: thread[0],
                      agent_cpu=(lambda: (cpu[0], submitted[0], done[0])) if charge_sender else None)
    train = agent = 0.0
    history: list[tuple[float, float, int]] = []
    queue: list[int] = []   # the call (counted over the run) at which each record not yet sent goes out
    sampler.take_step(0)
    for step in range(steps):
        if step == pause_at:
            now[0] += 500.0                      # an evaluation between two steps: not training time it earns
        captured = 0
        for i in range(calls):
            while queue and queue[0] <= step * calls + i:   # the sender's turn on the core
                queue.pop(0)
                now[0] += record_cpu
                cpu[0] += record_cpu
                agent += record_cpu
                done[0] += 1
            now[0] += 1e-3
            thread[0] += 1e-3
            train += 1e-3
            if sampler.take(("Functional", f"api{i % sites}", (), True)):
                now[0] += capture
                thread[0] += capture
                agent += capture
                submitted[0] += 1
                queue.append(step * calls + i + lag)
                captured += 1
        history.append((train, agent + len(queue) * record_cpu, captured))
        sampler.take_step(step + 1)
    return sampler, history


def test_overhead_budget_holds_from_the_first_step_and_charges_the_sender_cpu():
    budget, steps, call_cost = 0.1, 200, 0.4e-3 + 0.5e-3
    sampler, history = _simulate(budget, steps)
    # from the first step on, the agent's cost (training thread and sender) stays within the budget of the
    # training's time so far, give or take one call
    for step, (train, agent, _) in enumerate(history):
        assert agent <= budget * train + call_cost, (step, train, agent)
    # the first step is not captured whole (every call site is new in it): its call sites are spread over steps
    assert 0 < history[0][2] < 24, history[0]
    c = sampler.report()
    assert c["new_call_sites"] == c["call_sites"] == 24
    assert all(sampler.last.get(("Functional", f"api{i}", (), True)) is not None for i in range(24))
    # the budget is used, not left idle: whole steps are taken once the call sites are covered
    train, agent, _ = history[-1]
    assert agent >= 0.6 * budget * train, (train, agent)
    assert c["steps_taken"] >= 5 and c["steps_skipped_budget"] > c["steps_taken"], c
    assert sum(1 for h in history if h[2] == 96) == c["steps_taken"]   # taken steps are taken whole
    assert c["agent_cpu_us"] > 0 and abs(c["call_cost_us"] - 400) <= 1   # measured: 0.4 ms a call
    # the same decisions again: they depend only on the measured times
    assert _simulate(budget, steps)[1] == history


def test_overhead_budget_charges_the_sender_cpu():
    # a sender that costs 2 ms of CPU per record: charged, the budget holds from the first step on; not charged (the
    # training thread's step time alone, as before) and running during the next step (it lengthens the steps that
    # capture nothing, which then pass for the training's own time), the agent costs 12 times its budget
    _, charged = _simulate(0.1, 120, record_cpu=2e-3)
    for step, (train, agent, _) in enumerate(charged):
        assert agent <= 0.1 * train + 2.4e-3, (step, train, agent)
    _, late = _simulate(0.1, 120, record_cpu=2e-3, lag=96)
    _, blind = _simulate(0.1, 120, record_cpu=2e-3, lag=96, charge_sender=False)
    train, agent, _ = late[-1]
    assert agent <= 0.1 * train, (train, agent)
    train, agent, _ = blind[-1]
    assert agent > 10 * 0.1 * train, (train, agent)
    assert sum(h[2] for h in late) * 10 < sum(h[2] for h in blind)


@pytest.mark.parametrize("pause_at", [60, 0, 1])
def test_overhead_budget_a_pause_does_not_open_the_budget(pause_at):
    """A pause between steps, or in the first steps before anything is known of a step (start-up, a compile, a data
    loader: 0 and 1), earns as much as 3 steps at most (before the fix, a pause in the first step had every later
    step taken whole: 9 times the budget)."""
    _, history = _simulate(0.1, 80, pause_at=pause_at)
    # one whole step taken earlier than without it, no more
    taken = sum(1 for h in history[pause_at:] if h[2])
    assert taken <= sum(1 for h in _simulate(0.1, 80)[1][pause_at:] if h[2]) + 1, [h[2] for h in history[pause_at:]]
    for train, agent, _ in history:   # the pause counted as 3 steps of 96 ms of training, at most
        assert agent <= 0.1 * (train + (2 * 0.096 if train > pause_at * 0.096 else 0.0)) + 0.9e-3


def test_sampling_counts_travel_in_the_end_message_and_show_in_the_summary():
    counts = Counts(captured=5, sent=5, acknowledged=5,
                    sampling={"calls": 20, "captured": 5, "skipped_repeats": 15, "call_sites": 3})
    end = pb.Frame.FromString(end_frame(StreamIdentity("run", 3, 8), counts, 5)).end
    assert dict(end.sampling) == counts.sampling and end.world_size == 8
    summary = Summary()
    summary.rank_ended("run", 3, {"captured": 5, "sampling": dict(end.sampling)})
    assert summary.as_dict()["ranks_ended"][0]["sampling"]["skipped_repeats"] == 15
    assert "sampling: " in summary.human() and "skipped_repeats 15" in summary.human()


# -- 8 ranks x 2 servers ---------------------------------------------------------------------------------------
# argv: config, steps. Each rank has its own batch size (its own call sites). Prints the call site of every call
# name of a step, found by a plain recording mode (not the agent), then the agent's counts.
RANK_TRAIN = r'''
import json, os, sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from npu_agent import PrecisionDebugger
from npu_agent import naming

cfg, steps = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(2 + rank % 3, 16), torch.randint(0, 4, (2 + rank % 3,))

def step():
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss

class Sites(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.counters, self.sites = naming.Counters(), {}
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = naming.classify(func)
        if info is not None and torch._C._current_graph_task_id() == -1:
            name = self.counters.next_name(*info)
            shapes = [(list(t.shape), str(t.dtype)) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)]
            self.sites[name] = json.dumps([".".join(info), shapes, torch.is_grad_enabled()])
        return func(*args, **kwargs)

rec = Sites()
with rec:
    step()
model.zero_grad()
print("SITES " + json.dumps(rec.sites))
dbg = PrecisionDebugger(config_path=cfg)
for _ in range(steps):
    dbg.start()
    step()
    dbg.stop()
    opt.step()
    opt.zero_grad()
    dbg.step()
print("COUNTS " + json.dumps(dbg.close()))
'''

WORLD, STEPS, K = 8, 3, 2


def _line(proc, tag: str) -> dict:
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith(tag + " ")][-1][len(tag) + 1:])


def test_eight_ranks_two_servers_coverage_checks_every_call_site(tmp_path):
    work = str(tmp_path)
    with Server(work, out=os.path.join(work, "a")) as a, Server(work, out=os.path.join(work, "b")) as b:
        cfg = agent_config(os.path.join(work, "agent.json"), host=[f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"],
                           online_coverage_steps=K)
        results = run_ranks(RANK_TRAIN, [([cfg, str(STEPS)], {"RANK": str(r), "WORLD_SIZE": str(WORLD),
                                                               "OMP_NUM_THREADS": "1"}) for r in range(WORLD)],
                            timeout=400)
    all_sites = set()
    for r in range(WORLD):
        out = (a if r % 2 == 0 else b).out
        sites = _line(results[r], "SITES")
        counts = _line(results[r], "COUNTS")
        assert counts["captured"] == counts["acknowledged"] and counts["dropped"] == 0, (r, counts)
        rows = read_csv(out, "accuracy_checking_result", rank=r)
        per_step: dict[int, list[str]] = {}
        for row in rows:
            per_step.setdefault(int(row["Step"]), []).append(sites[row["API name"]])
        distinct = set(sites.values())
        # every call site of this rank was checked in step 0, none twice; step 1 would repeat them all: it is not
        # watched (npu_agent/sampling.py); step 2 is K steps later: every call site once again
        assert sorted(per_step) == [0, 2], (r, sorted(per_step))
        for s in (0, 2):
            assert sorted(per_step[s]) == sorted(distinct), (r, s)
        assert len(distinct) < len(sites)        # the model repeats call sites: repeats were skipped
        sampling = counts["sampling"]
        assert sampling["call_sites"] == len(distinct) and sampling["captured"] == 2 * len(distinct)
        assert sampling["steps_unwatched"] == 1   # step 1: nothing to capture, the mode is not even pushed
        assert sampling["skipped_repeats"] == (STEPS - 1) * len(sites) - 2 * len(distinct)
        all_sites |= {(r % 3, s) for s in distinct}
    assert len(all_sites) == 3 * len(distinct)   # three batch sizes: three sets of call sites across the ranks
    for srv, ranks in ((a, range(0, WORLD, 2)), (b, range(1, WORLD, 2))):
        with open(glob.glob(os.path.join(srv.out, "summary_*.json"))[0]) as fh:
            ended = {e["rank"] for e in json.load(fh)["ranks_ended"]}
        assert ended == set(ranks)
