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
sender's and gRPC's threads left out). `--baseline PATH` runs the same measures first against the checkout at PATH
(a `git worktree add --detach /tmp/base HEAD` of the previous main) in a subprocess and prints them before/after.
Ratios are printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402  (pins this process to one core and torch to one thread on import)
import torch  # noqa: E402

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


def _baseline(path: str, argv: list[str]) -> dict:
    """This benchmark run again (a subprocess) against the checkout at `path`; its results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "baseline.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--repo", path, "--json", out],
                       check=True, cwd=path, env=dict(os.environ, PYTHONPATH=path))
        with open(out) as fh:
            result: dict = json.load(fh)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated names of POLICIES")
    p.add_argument("--baseline", metavar="PATH", help="the same measures of the checkout at PATH, printed before")
    p.add_argument("--repo", metavar="PATH", help=argparse.SUPPRESS)   # read at import (overhead._repo_arg)
    p.add_argument("--json", metavar="PATH", help=argparse.SUPPRESS)   # --baseline's subprocess: results to PATH
    ns = p.parse_args()
    policies = {name: POLICIES[name] for name in ns.policies.split(",")}
    base = None
    if ns.baseline:
        base = _baseline(ns.baseline, ["--steps", str(ns.steps), "--rounds", str(ns.rounds), "--layers",
                                       str(ns.layers), "--policies", ns.policies])
    r = measure(ns.steps, ns.rounds, ns.layers, policies)
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(r, fh)
        return
    report(r, base)


def measure(steps: int, rounds: int, layers: int, policies: dict) -> dict:
    """Each policy's CPU, wall and training thread CPU per step, off and the no-op mode's, and the agents' counts."""
    work = tempfile.mkdtemp(prefix="bench-sampling-")
    port = overhead._free_port()
    server_cfg = os.path.join(work, "server.json")
    with open(server_cfg, "w") as fh:
        json.dump({"task": "run_ut", "run_ut": {"host": "127.0.0.1", "port": port, "is_online": True}}, fh)
    cfgs = {}
    for i, (name, keys) in enumerate(policies.items()):
        cfgs[name] = os.path.join(work, f"agent{i}.json")
        with open(cfgs[name], "w") as fh:
            json.dump({"task": "tensor", "level": "L1", "tensor": {"online_run_ut": True, "host": "127.0.0.1",
                                                                     "port": port, "online_memory_mb": 4096,
                                                                     **keys}}, fh)
    try:
        with overhead.checking_server(work, server_cfg, port):
            torch.manual_seed(0)
            model = TinyLM(vocab=96, d=64, heads=4, layers=layers, seq=32, dropout=0.0)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            data = list(batches(steps, batch=4, seq=32))
            overhead._round(model, opt, data[:2], None)
            counting = overhead._ModeOnly(overhead._CountingMode())
            overhead._round(model, opt, data[:1], counting)
            variants = {"off": None, "no-op mode": overhead._ModeOnly(overhead._NoOpMode()),
                        **{name: overhead._Online(cfg) for name, cfg in cfgs.items()}}
            # Each agent's start-up (its connection, its hooks) happens once per training, not per step: it is
            # timed here, apart, and the rounds measure steps only.
            startup = {}
            for name, variant in variants.items():
                if name in cfgs:
                    c0 = time.process_time()
                    variant.dbg._ensure_started()
                    startup[name] = time.process_time() - c0
            cpu = dict.fromkeys(variants, 0.0)
            wall = dict.fromkeys(variants, 0.0)
            thread = dict.fromkeys(variants, 0.0)
            for _ in range(rounds):
                for name, dbg in variants.items():
                    c, w, t = _round(model, opt, data, dbg)
                    cpu[name] += c
                    wall[name] += w
                    thread[name] += t
            counts = {name: dbg.dbg.close() for name, dbg in variants.items() if name in cfgs}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = steps * rounds
    return {"repo": overhead.REPO, "layers": layers, "steps": n, "calls": counting.mode.calls,
            "cpu": {k: v / n for k, v in cpu.items()}, "wall": {k: v / n for k, v in wall.items()},
            "thread": {k: v / n for k, v in thread.items()}, "counts": counts, "startup": startup,
            "train_core": overhead.TRAIN_CORE, "server_core": overhead.SERVER_CORE}


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
