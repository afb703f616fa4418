"""Fidelity of the verdicts: false alarms on a correct device that rounds differently, and faults caught on it.

    python bench/fidelity.py [--seeds 1] [--skip-sweep]

1. The second, correct device (tests/second_device.py) trains the small models (TinyLM, ConvNet, MoE router,
   attention with dropout) in float32 / bfloat16 / float16 for each seed against one real gpu-server; every
   `error` row is a false alarm. Prints false-error API calls per 1,000 checked API calls for each report, and how
   many rows passed only by the spread rules (docs/standards.md: rows msprobe's rules alone would have failed).
2. Every fault of tests/faulty_kernels.py on the second device's background: caught exactly when the precision
   report flags exactly its API calls and direction (test_faulty_device.py's expectations).
3. The smallest elementwise fault still caught: bfloat16 `mul` off by k ULP on a share of elements (sweep).

Attention with dropout inside the fused op is SKIP only with the random-API replay (branch `replay`); its rows are
counted separately so that the figure for the rest stays readable.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests import support  # noqa: E402
from tests.faulty_kernels import flagged, run_trainings  # noqa: E402

MODELS = [("tinylm", 0.0), ("convnet", 0.0), ("moe", 0.0)]
DTYPES = ["float32", "bfloat16", "float16"]
SPREAD_NOTES = ("against the same-dtype run only", "a correct same-dtype run", "(a share of few elements)",
                "Wilson bounds): pass", "<= 1.0 against the spread")


def _server(work: str) -> support.Server:
    os.environ["OMP_NUM_THREADS"] = "1"
    return support.Server(work).start()


def _run(runs: list[list[str]], env: dict | None = None) -> str:
    work = tempfile.mkdtemp(prefix="fidelity_")
    server = _server(work)
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        config = support.agent_config(os.path.join(work, "agent.json"), server.port)
        run_trainings(config, runs)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        code = server.stop()
    if code:
        raise SystemExit(f"gpu-server exited with {code}: {server.log()}")
    return server.out


def clean_runs(seeds: int) -> None:
    runs, labels = [], []
    for seed in range(seeds):
        for model, dropout in MODELS:
            for dtype in DTYPES:
                runs.append(["--model", model, "--dtype", dtype, "--seed", str(seed), "--dropout", str(dropout),
                             "--second-device"])
                labels.append(f"{model}/{dtype}/seed{seed}")
        runs.append(["--model", "attn", "--dtype", "float32", "--seed", str(seed), "--dropout", "0.1",
                     "--second-device"])
        labels.append(f"attn-dropout/float32/seed{seed}")
    t0 = time.time()
    out = _run(runs)
    calls = {"main": 0, "attn": 0}
    errors = {k: {"precision": 0, "two-way": 0} for k in calls}
    rescued = 0
    examples = []
    for rank, label in enumerate(labels):
        kind = "attn" if label.startswith("attn") else "main"
        results = support.read_csv(out, "api_precision_compare_result", rank)
        calls[kind] += sum((r["Forward Test Success"] != " ") + (r["Backward Test Success"] != " ") for r in results)
        errors[kind]["precision"] += len(flagged(out, rank, "api_precision_compare_result"))
        errors[kind]["two-way"] += len(flagged(out, rank, "accuracy_checking_result"))
        for kind_file, col in (("api_precision_compare_details", "比对结果"), ("accuracy_checking_details", "Status")):
            for row in support.read_csv(out, kind_file, rank):
                if row[col] == "pass" and any(n in row["Message"] for n in SPREAD_NOTES):
                    rescued += 1
                    if len(examples) < 3:
                        examples.append(f"{label} {row['API Name']}: {row['Message'][:160]}")
                if row[col] == "error" and kind == "main":
                    examples.append(f"FALSE ERROR {label} {row['API Name']}: {row['Message'][:200]}")
    print(f"== second device, {len(labels)} trainings ({seeds} seed(s) x {len(MODELS)} models x {len(DTYPES)} dtypes"
          f" + attention with dropout), {time.time() - t0:.0f} s")
    for kind, title in (("main", "TinyLM / ConvNet / MoE"), ("attn", "attention with dropout")):
        n = max(calls[kind], 1)
        print(f"  {title}: {calls[kind]} checked API calls (directions); false errors per 1,000: precision "
              f"{1000 * errors[kind]['precision'] / n:.2f}, two-way {1000 * errors[kind]['two-way'] / n:.2f}")
    print(f"  rows that pass only by the spread rules (msprobe's rules alone: error or Warning): {rescued}")
    for line in examples:
        print("   ", line)


def fault_runs() -> None:
    from tests.test_faulty_device import CASES, MAY_ALSO

    names = list(CASES)
    t0 = time.time()
    out = _run([CASES[c][0] + ["--case", c, "--second-device"] for c in names])
    exact = 0
    for rank, case in enumerate(names):
        found = flagged(out, rank, "api_precision_compare_result")
        required, allowed = CASES[case][1], CASES[case][1] | MAY_ALSO.get(case, set())
        ok = required <= found <= allowed
        exact += ok
        extra = sorted(found - allowed)
        missed = sorted(required - found)
        print(f"  {case:30s} {'caught exactly' if ok else 'NOT exact'}: {len(found)} flagged"
              + (f", missed {missed}" if missed else "") + (f", also {extra}" if extra else ""))
    print(f"== faults on the second device: {exact} of {len(names)} caught exactly ({time.time() - t0:.0f} s)")


def sweep() -> None:
    variants = [(1, 1), (1, 10), (2, 1), (2, 10)]   # (ULPs, per mille of the elements)
    t0 = time.time()
    out = _run([["--model", "convnet", "--dtype", "bfloat16", "--case", "mul_ulp_1pct", "--second-device",
                 "--fault-ulps", str(ulps), "--fault-per-mille", str(per_mille)] for ulps, per_mille in variants])
    caught = []
    for rank, (ulps, per_mille) in enumerate(variants):
        found = flagged(out, rank, "api_precision_compare_result")
        hit = ("Tensor.mul.0", "forward") in found and all(name.startswith("Tensor.mul.") for name, _ in found)
        print(f"  bfloat16 mul, {ulps} ULP on {per_mille / 10:g} % of the elements: "
              f"{'caught' if hit else 'missed'} ({sorted(found)})")
        if hit:
            caught.append((ulps, per_mille))
    if caught:
        ulps, per_mille = min(caught)
        print(f"== smallest elementwise fault caught: {ulps} ULP on {per_mille / 10:g} % of bfloat16 elements "
              f"({time.time() - t0:.0f} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--skip-sweep", action="store_true")
    ns = p.parse_args()
    clean_runs(ns.seeds)
    fault_runs()
    if not ns.skip_sweep:
        sweep()


if __name__ == "__main__":
    main()
