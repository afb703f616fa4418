"""Coverage reached and training cost of each sampling policy, side by side in one run, on a 16-layer model.

    python bench/sampling.py [--steps 12] [--rounds 2] [--layers 16] [--policies "coverage K=4,budget 10 %"]
                             [--baseline PATH]

Model: TinyLM with 16 layers (d=64, 4 heads, seq 32, batch 4, float32): each layer repeats the call sites of the
others, as in a real deep model. Each policy is the real agent (its own PrecisionDebugger and config) streaming to
one real gpu-server subprocess on another core; the training runs on one core (bench/overhead.py's set-up). Cost
per step includes waiting until the server acknowledged every record of the round; each agent's start-up (its
connection to the server, its hooks: once per training) is timed apart, before the rounds. Coverage: the distinct call
sites (API, input shapes and dtypes, direction) captured at least once, of those met; calls captured, of the calls
the sampler saw (the calls of a step the agent does not watch are not seen: npu_agent.sampling, "Steps the agent
does not watch"; their number is printed as "steps not watched").
The floor: a TorchFunctionMode that does nothing, pushed around forward and backward as the agent's mode is ("no-op
mode"); each policy's CPU is also given as a ratio of it, and its training thread's CPU (`time.thread_time`: the
sender's and gRPC's threads left out), and under each policy's line the CPU a record of each of the agent's
threads, read from the scheduler's count per thread (bench/measuring.py `thread_cpu`): the sender (encoding), the
stream's reader (the server's answers), gRPC's Python threads (requests handed to gRPC, answers delivered) and its
C core. `--baseline PATH` also measures the checkout at PATH (a `git worktree add
--detach /tmp/base HEAD` of the previous main; this benchmark, that checkout's agent and server) and prints both
before/after: each checkout in a process that stays up with its own server, the rounds alternating between them
(the order reversed every other round). Run one after the other, drift made the second run's policy cheaper than
its own off steps (x0.97 of off, after x1.14 in the run before it). Ratios are printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402  (pins this process to one core and torch to one thread on import)
import torch  # noqa: E402
from measuring import (  # noqa: E402  (bench/measuring.py, beside this file)
    MeasuringProcess,
    agent_threads_line,
    agent_threads_since,
    in_turn,
    thread_cpu,
)

from examples.demo import TinyLM, batches  # noqa: E402

POLICIES = {
    "every call": {},
    "every 4th step": {"online_sample_steps": 4},
    "ranks 1 of 4": {"online_sample_ranks": 4},
    "coverage K=4": {"online_coverage_steps": 4},
    "coverage K=1": {"online_coverage_steps": 1},
    "budget 10 %": {"online_overhead_budget": 0.1},
}


def _round(model, opt, data, dbg) -> tuple[float, float, float]:
    """overhead._round, with the training thread's CPU."""
    t0 = time.thread_time()
    c, w, _, _ = overhead._round(model, opt, data, dbg)
    return c, w, time.thread_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated names of POLICIES")
    p.add_argument("--baseline", metavar="PATH", help="the same measures of the checkout at PATH, the rounds "
                   "alternating, printed before/after")
    p.add_argument("--repo", metavar="PATH", help=argparse.SUPPRESS)   # read at import (overhead._repo_arg)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)   # a --baseline measuring process
    ns = p.parse_args()
    policies = {name: POLICIES[name] for name in ns.policies.split(",")}
    if ns.serve:
        serve(ns.steps, ns.layers, policies)
        return
    if ns.baseline:
        argv = ["--steps", str(ns.steps), "--layers", str(ns.layers), "--policies", ns.policies]
        base, r = alternating(ns.baseline, argv, ns.rounds)
        report(r, base)
        return
    report(measure(ns.steps, ns.rounds, ns.layers, policies), None)


class Sampling:
    """The measures of one checkout in this process: a real gpu-server, the model, off, the no-op mode and one
    agent per policy. `round()` runs every variant over the steps once and adds up its CPU, wall and training
    thread CPU; `finish()` closes the agents and the server and returns the results per step."""

    def __init__(self, steps: int, layers: int, policies: dict) -> None:
        self.steps, self.layers, self.rounds = steps, layers, 0
        self.work = tempfile.mkdtemp(prefix="bench-sampling-")
        self.stack = contextlib.ExitStack()
        try:
            self._start(policies)
        except BaseException:
            self.stack.close()
            shutil.rmtree(self.work, ignore_errors=True)
            raise

    def _start(self, policies: dict) -> None:
        port = overhead._free_port()
        server_cfg = os.path.join(self.work, "server.json")
        with open(server_cfg, "w") as fh:
            json.dump({"task": "run_ut", "run_ut": {"host": "127.0.0.1", "port": port, "is_online": True}}, fh)
        self.cfgs = {}
        for i, (name, keys) in enumerate(policies.items()):
            self.cfgs[name] = os.path.join(self.work, f"agent{i}.json")
            with open(self.cfgs[name], "w") as fh:
                json.dump({"task": "tensor", "level": "L1", "tensor": {"online_run_ut": True, "host": "127.0.0.1",
                                                                         "port": port, "online_memory_mb": 4096,
                                                                         **keys}}, fh)
        self.stack.enter_context(overhead.checking_server(self.work, server_cfg, port))
        torch.manual_seed(0)
        self.model = TinyLM(vocab=96, d=64, heads=4, layers=self.layers, seq=32, dropout=0.0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.data = list(batches(self.steps, batch=4, seq=32))
        overhead._round(self.model, self.opt, self.data[:2], None)
        counting = overhead._ModeOnly(overhead._CountingMode())
        overhead._round(self.model, self.opt, self.data[:1], counting)
        self.calls = counting.mode.calls
        self.variants = {"off": None, "no-op mode": overhead._ModeOnly(overhead._NoOpMode()),
                         **{name: overhead._Online(cfg) for name, cfg in self.cfgs.items()}}
        # Each agent's start-up (its connection, its hooks) happens once per training, not per step: it is timed
        # here, apart, and the rounds measure steps only.
        self.startup = {}
        for name, variant in self.variants.items():
            if name in self.cfgs:
                c0 = time.process_time()
                variant.dbg._ensure_started()
                self.startup[name] = time.process_time() - c0
        self.cpu = dict.fromkeys(self.variants, 0.0)
        self.wall = dict.fromkeys(self.variants, 0.0)
        self.thread = dict.fromkeys(self.variants, 0.0)
        self.agent_threads: dict[str, dict[str, float]] = {name: {} for name in self.cfgs}

    def round(self) -> None:
        for name, dbg in self.variants.items():
            before = thread_cpu() if name in self.cfgs else None
            c, w, t = _round(self.model, self.opt, self.data, dbg)
            self.cpu[name] += c
            self.wall[name] += w
            self.thread[name] += t
            if before is not None:   # an agent (the other agents' threads are idle meanwhile: each round ends drained)
                roles = self.agent_threads[name]
                for role, seconds in agent_threads_since(before).items():
                    roles[role] = roles.get(role, 0.0) + seconds
        self.rounds += 1

    def finish(self) -> dict:
        try:
            counts = {name: dbg.dbg.close() for name, dbg in self.variants.items() if name in self.cfgs}
        finally:
            self.stack.close()
            shutil.rmtree(self.work, ignore_errors=True)
        n = self.steps * self.rounds
        agent = os.path.dirname(os.path.dirname(os.path.abspath(overhead.location.__file__)))   # measured
        return {"repo": agent, "layers": self.layers, "steps": n, "calls": self.calls,
                "cpu": {k: v / n for k, v in self.cpu.items()}, "wall": {k: v / n for k, v in self.wall.items()},
                "thread": {k: v / n for k, v in self.thread.items()}, "counts": counts, "startup": self.startup,
                "agent_threads": self.agent_threads,
                "train_core": overhead.TRAIN_CORE, "server_core": overhead.SERVER_CORE}


def measure(steps: int, rounds: int, layers: int, policies: dict) -> dict:
    """Each policy's CPU, wall and training thread CPU per step, off and the no-op mode's, and the agents' counts."""
    run = Sampling(steps, layers, policies)
    try:
        for _ in range(rounds):
            run.round()
    except BaseException:
        run.finish()
        raise
    return run.finish()


def serve(steps: int, layers: int, policies: dict) -> None:
    """A measuring process of `--baseline`: Sampling set up once, then one round per 'round' line on stdin
    (answered 'done'), and the results as a JSON line on 'finish'."""
    run = Sampling(steps, layers, policies)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "round":
            run.round()
            print("done", flush=True)
        elif line.strip() == "finish":
            print(json.dumps(run.finish()), flush=True)
            return
    run.finish()


def alternating(baseline: str, argv: list[str], rounds: int) -> tuple[dict, dict]:
    """(before, after): the checkout at `baseline` and this one, each measured by a process that stays up, the
    rounds alternating between them (the order reversed every other round): this VM's speed drifts 10-30 % within
    minutes, which a run of one after the other reads as a change."""
    procs = {label: MeasuringProcess(__file__, repo, ["--serve", "--repo", repo, *argv], overhead.ALL_CORES)
             for label, repo in (("before", os.path.abspath(baseline)), ("after", overhead.REPO))}
    try:
        for proc in procs.values():   # both set up meanwhile
            proc.ready()
        for r in range(rounds):
            for label in in_turn(("before", "after"), r):
                procs[label].ask("round", "done")
        return (json.loads(procs["before"].ask("finish", "{")), json.loads(procs["after"].ask("finish", "{")))
    finally:
        for proc in procs.values():
            proc.close()


def _lines(r: dict) -> list[tuple[str, str]]:
    """(policy, its line of ratios and coverage) of one run."""
    cpu, wall, thread = r["cpu"], r["wall"], r["thread"]
    out = []
    for name, c in r["counts"].items():
        s = c.get("sampling")
        calls = s["calls"] if s else c["forward_calls"]
        captured = s["captured"] if s else c["forward_calls"]
        sites = "all" if not s else f"{s['new_call_sites']} of {s['call_sites']}"
        out.append((name, f"CPU x{cpu[name] / cpu['off']:5.2f} of off, x{cpu[name] / cpu['no-op mode']:5.2f} of the "
                          f"no-op mode; training thread x{thread[name] / thread['off']:5.2f} of off, "
                          f"x{thread[name] / thread['no-op mode']:5.2f} of the no-op mode; wall "
                          f"x{wall[name] / wall['off']:5.2f}; calls captured "
                          f"{100 * captured / max(calls, 1):5.1f} % of those seen; "
                          f"call sites covered {sites}"))
    return out


def report(r: dict, base: dict | None) -> None:
    n = r["steps"]
    print(f"TinyLM {r['layers']} layers (d=64, seq 32, batch 4, float32), {n} steps a policy, training on core "
          f"{r['train_core']}, server on core {r['server_core']}; {r['calls']} calls a step seen by the mode")
    runs = [("before", base), ("after", r)] if base is not None else [("", r)]
    for label, run in runs:
        if label:
            print(f"[{label}: {run['repo']}]")
        print("  ms/step: " + "   ".join(f"{k} CPU {v * 1e3:.2f} (thread {run['thread'][k] * 1e3:.2f})"
                                        for k, v in run["cpu"].items() if k in ("off", "no-op mode")))
        for name, c in run["counts"].items():
            s = c.get("sampling")
            extra = (f"call sites {s['call_sites']}, skipped: steps {s['skipped_steps']}, ranks {s['skipped_ranks']}, "
                     f"repeats {s['skipped_repeats']}, budget {s['skipped_budget']} ({s['steps_skipped_budget']} "
                     f"steps); steps not watched {s.get('steps_unwatched', 0)}" if s else "no sampling")
            if s and "agent_cpu_us" in s:   # what the budget charged: the senders' CPU, a captured call's estimate
                extra += (f"; the budget charged the senders' CPU {s['agent_cpu_us'] / 1e3:.1f} ms and "
                          f"{s['call_cost_us'] / 1e3:.2f} ms a captured call in the training thread")
            start = run.get("startup", {}).get(name)
            extra += f"; start-up {start * 1e3:.0f} ms CPU, once (not in the steps)" if start is not None else ""
            print(f"  {name:15s} CPU {run['cpu'][name] * 1e3:7.2f} ms/step (thread {run['thread'][name] * 1e3:7.2f}); "
                  f"records {c['captured']:6d} (acknowledged {c['acknowledged']}); {extra}")
            roles = run.get("agent_threads", {}).get(name)   # (absent from a baseline checkout's older bench)
            if roles and c["captured"]:
                print(f"  {'':15s} the agent's threads, CPU a record: {agent_threads_line(roles, c['captured'])}")
    print(f"\nno-op mode (the floor): CPU x{r['cpu']['no-op mode'] / r['cpu']['off']:5.2f} of off")
    print("ratios and coverage")
    before = dict(_lines(base)) if base is not None else {}
    for name, line in _lines(r):
        if name in before:
            print(f"  {name:15s} before: {before[name]}")
            print(f"  {'':15s} after:  {line}")
        else:
            print(f"  {name:15s} {line}")


if __name__ == "__main__":
    main()
