"""Coverage reached and training cost of each sampling policy, side by side in one run, on a 16-layer model.

    python bench/sampling.py [--steps 12] [--rounds 2] [--layers 16]

Model: TinyLM with 16 layers (d=64, 4 heads, seq 32, batch 4, float32): each layer repeats the call sites of the
others, as in a real deep model. Each policy is the real agent (its own PrecisionDebugger and config) streaming to
one real gpu-server subprocess on another core; the training runs on one core (bench/overhead.py's set-up). Cost
per step includes waiting until the server acknowledged every record of the round. Coverage: the distinct call
sites (API, input shapes and dtypes, direction) captured at least once, of those met; calls captured, of all calls.
Ratios are printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    ns = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-sampling-")
    port = overhead._free_port()
    server_cfg = os.path.join(work, "server.json")
    with open(server_cfg, "w") as fh:
        json.dump({"task": "run_ut", "run_ut": {"host": "127.0.0.1", "port": port, "is_online": True}}, fh)
    cfgs = {}
    for i, (name, keys) in enumerate(POLICIES.items()):
        cfgs[name] = os.path.join(work, f"agent{i}.json")
        with open(cfgs[name], "w") as fh:
            json.dump({"task": "tensor", "level": "L1", "tensor": {"online_run_ut": True, "host": "127.0.0.1",
                                                                     "port": port, "online_memory_mb": 4096,
                                                                     **keys}}, fh)
    try:
        with overhead.checking_server(work, server_cfg, port):
            torch.manual_seed(0)
            model = TinyLM(vocab=96, d=64, heads=4, layers=ns.layers, seq=32, dropout=0.0)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            data = list(batches(ns.steps, batch=4, seq=32))
            overhead._round(model, opt, data[:2], None)
            variants = {"off": None, **{name: overhead._Online(cfg) for name, cfg in cfgs.items()}}
            cpu = dict.fromkeys(variants, 0.0)
            wall = dict.fromkeys(variants, 0.0)
            for _ in range(ns.rounds):
                for name, dbg in variants.items():
                    c, w, _, _ = overhead._round(model, opt, data, dbg)
                    cpu[name] += c
                    wall[name] += w
            counts = {name: dbg.dbg.close() for name, dbg in variants.items() if dbg is not None}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = ns.steps * ns.rounds
    every = counts["every call"]
    calls = every["forward_calls"]
    print(f"TinyLM {ns.layers} layers (d=64, seq 32, batch 4, float32), {n} steps a policy, training on core "
          f"{overhead.TRAIN_CORE}, server on core {overhead.SERVER_CORE}; {calls / n:.0f} forward calls a step")
    rows = []
    for name in variants:
        if name == "off":
            continue
        c = counts[name]
        s = c.get("sampling")
        sites = s["call_sites"] if s else None
        captured = s["captured"] if s else c["forward_calls"]
        rows.append((name, captured, sites, c))
        extra = (f"call sites {sites}, skipped: steps {s['skipped_steps']}, ranks {s['skipped_ranks']}, repeats "
                 f"{s['skipped_repeats']}, budget {s['skipped_budget']} ({s['steps_skipped_budget']} steps)"
                 if s else "no sampling")
        print(f"  {name:15s} records {c['captured']:6d} (acknowledged {c['acknowledged']}); {extra}")
    print("\nratios (of off) and coverage")
    for name, captured, sites, _ in rows:
        cov = "all" if sites is None else f"all {sites} (each at its first call)"
        print(f"  {name:15s} CPU x{cpu[name] / cpu['off']:5.2f}   wall x{wall[name] / wall['off']:5.2f}   "
              f"calls captured {100 * captured / calls:5.1f} %   call sites covered {cov}")


if __name__ == "__main__":
    main()
