"""Fidelity of the verdicts: false alarms on a correct device that rounds differently, and faults caught on it.

    python bench/fidelity.py [--seeds 1] [--skip-sweep] [--gelu-sweep] [--only-measure]

1. The second, correct device (tests/second_device.py) trains the small models (TinyLM, ConvNet, MoE router,
   attention with dropout) in float32 / bfloat16 / float16 for each seed against one real gpu-server; every
   `error` row is a false alarm. Prints false-error API calls per 1,000 checked API calls for each report, and how
   many rows passed only by the spread rules (docs/standards.md: rows msprobe's rules alone would have failed).
2. Every fault of tests/faulty_kernels.py on the second device's background: caught exactly when the precision
   report flags exactly its API calls and direction (test_faulty_device.py's expectations).
3. The smallest elementwise fault still caught: bfloat16 `mul` off by k ULP on a share of elements (sweep);
   with --gelu-sweep also the smallest bias of F.gelu (1 + 2^-K) that the benchmark standard catches.
4. Judging across calls (gpu_server/checking/pooled.py, docs/pooled.md): the pooled test's false findings over the
   second-device runs of 1., and the smallest bias it finds per dtype, side by side with the per-call reports: one
   server session per variant of a sweep of `--fault-per-mille` (bfloat16 `mul`, `--fault-ulps 1`, ConvNet) and of
   `--gelu-scale-log2` (TinyLM, the demo model, bfloat16 / float16 / float32), 2 training steps each.
5. The cost of saying where: the module path and source line of each captured call, in us (npu_agent/location.py).

    python bench/fidelity.py --skip-measure --skip-faults --skip-sweep    # 1. and 4. only

Attention with dropout inside the fused op is SKIP only with the random-API replay (branch `replay`); its rows are
counted separately so that the figure for the rest stays readable.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gpu_server.reports import files as report_files  # noqa: E402
from tests import support  # noqa: E402
from tests.faulty_kernels import flagged, run_trainings  # noqa: E402

MODELS = [("tinylm", 0.0), ("convnet", 0.0), ("moe", 0.0)]
DTYPES = ["float32", "bfloat16", "float16"]
SPREAD_NOTES = ("against the same-dtype run only", "a correct same-dtype run", "(a share of few elements)",
                "Wilson bounds): pass", "<= 1.0 against the spread", "elements outside (Wilson bounds")


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
        if env:   # (never emptied otherwise: pooled_sweep runs sessions from several threads)
            os.environ.clear()
            os.environ.update(saved)
        code = server.stop()
    if code:
        raise SystemExit(f"gpu-server exited with {code}: {server.log()}")
    return server.out


def _pooled(out: str) -> tuple[list[dict], dict]:
    """The session's api_bias CSV rows (gpu_server/checking/pooled.py) and the summary's api_bias ({} when absent)."""
    import csv
    import glob
    import json

    rows: list[dict] = []
    for path in glob.glob(report_files.api_bias_path(out, "*")):
        with open(path, encoding="utf-8-sig", newline="") as fh:
            rows.extend(csv.DictReader(fh))
    summary: dict = {}
    for path in glob.glob(report_files.summary_path(out, "*")):
        with open(path, encoding="utf-8") as fh:
            summary = json.load(fh).get("api_bias") or {}
    return rows, summary


def _print_pooled_false_findings(out: str) -> None:
    rows, summary = _pooled(out)
    informative = [r for r in rows if int(r["differing_elements"]) > 0]
    found = [r for r in rows if r["verdict"] != "pass"]
    notes = [r for r in rows if r["verdict"] == "pass" and r["reason"]]
    print(f"  pooled across calls: {len(found)} findings in {len(rows)} (API, direction, dtype) groups "
          f"({len(informative)} where the device differs from the same-dtype run; {summary.get('tests', '?')} tests "
          f"at a family-wise false-alarm rate of {summary.get('false_alarm_rate_per_api', '?')} per run): "
          f"false-finding rate {len(found) / max(1, len(informative)):.3g} per judged group")
    for r in found:
        print(f"    FALSE FINDING {r['api']} {r['direction']} {r['dtype']}: {r['reason'][:200]}")
    for r in notes:
        print(f"    (pass, with a note) {r['api']} {r['direction']} {r['dtype']}: {r['reason'][:160]}")


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
        results = support.read_csv(out, report_files.PRECISION_RESULT, rank)
        calls[kind] += sum((r["Forward Test Success"] != " ") + (r["Backward Test Success"] != " ") for r in results)
        errors[kind]["precision"] += len(flagged(out, rank, report_files.PRECISION_RESULT))
        errors[kind]["two-way"] += len(flagged(out, rank, report_files.RESULT))
        for kind_file, col in ((report_files.PRECISION_DETAILS, "比对结果"), (report_files.DETAILS, "Status")):
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
    _print_pooled_false_findings(out)


def fault_runs() -> None:
    from tests.test_faulty_device import CASES, MAY_ALSO

    names = list(CASES)
    t0 = time.time()
    out = _run([CASES[c][0] + ["--case", c, "--second-device"] for c in names])
    exact = 0
    for rank, case in enumerate(names):
        found = flagged(out, rank, report_files.PRECISION_RESULT)
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
        found = flagged(out, rank, report_files.PRECISION_RESULT)
        hit = ("Tensor.mul.0", "forward") in found and all(name.startswith("Tensor.mul.") for name, _ in found)
        print(f"  bfloat16 mul, {ulps} ULP on {per_mille / 10:g} % of the elements: "
              f"{'caught' if hit else 'missed'} ({sorted(found)})")
        if hit:
            caught.append((ulps, per_mille))
    if caught:
        ulps, per_mille = min(caught)
        print(f"== smallest elementwise fault caught: {ulps} ULP on {per_mille / 10:g} % of bfloat16 elements "
              f"({time.time() - t0:.0f} s)")


def _cast(v, dtypes):
    for d in dtypes:
        v = v.to(d)
    return v


def measure_spread(trials: int = 10) -> None:
    """In-process: per op family and dtype, the benchmark standard's ratios of the second device against the host's
    same-dtype run alone (msprobe) and against the spread (host + stochastic-rounding runs + the sequential run for
    a product, gpu_server/replay/spread.py), worst over trials. The last column compares the stochastic runs'
    RMSE with the host run's."""
    import torch

    from gpu_server.judging.metrics import output_metrics
    from gpu_server.judging.standards.thresholds import THRESHOLDS
    from gpu_server.replay.spread import SPREAD_RUNS, SequentialAccumulation, StochasticRounding
    from tests import second_device as sd

    def families(x, w, g, k):
        return {
            "mm": (lambda t: torch.mm(t(x), t(w)), lambda t: sd._mm(t(x), t(w))),
            "softmax fwd": (lambda t: torch.softmax(t(x), -1), lambda t: sd._softmax(t(x), -1, False)),
            "softmax bwd": (lambda t: torch.ops.aten._softmax_backward_data(t(g), torch.softmax(t(x), -1), -1,
                                                                            t(x).dtype),
                            lambda t: sd._softmax_backward(t(g), sd._softmax(t(x), -1, False), -1, t(x).dtype)),
            "layer_norm fwd": (lambda t: torch.nn.functional.layer_norm(t(x), [k]),
                               lambda t: sd._native_layer_norm(t(x), [k], None, None, 1e-5)[0]),
            "gelu fwd": (lambda t: torch.nn.functional.gelu(t(x)), lambda t: sd._gelu(t(x))),
        }

    keys = ("small_value_error_ratio", "rmse", "max_rel_err", "mean_rel_err")
    limits = dict(zip(keys, THRESHOLDS.benchmark_ratio_limits.values()))
    print(f"== spread measurements: worst ratio over {trials} random inputs (64 x 128), device = second device "
          f"(limits {limits})")
    print(f"  {'family':16s} {'dtype':9s} {'vs same-dtype run (msprobe)':>40s}   {'vs spread':>36s}   SR/host rmse")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        wide = torch.float64 if dtype == torch.float32 else torch.float32
        floor = THRESHOLDS.for_dtype(dtype).ratio_floor
        worst: dict = {}
        for trial in range(trials):
            gen = torch.Generator().manual_seed(trial)
            x = torch.randn(64, 128, generator=gen) * 2
            w = torch.randn(128, 64, generator=gen)
            g = torch.randn(64, 128, generator=gen)
            for name, (host, dev) in families(x, w, g, 128).items():
                low = functools.partial(_cast, dtypes=(dtype,))
                up = functools.partial(_cast, dtypes=(dtype, wide))
                bench = host(up)
                device, same = dev(low), host(low)
                members = []
                for run in range(SPREAD_RUNS):
                    with StochasticRounding(1000 * trial + run) as mode:
                        members.append(host(low))
                if mode.products:   # the server adds a sequential-accumulation run to a call with a product
                    with SequentialAccumulation():
                        members.append(host(low))
                md, ms = output_metrics(bench, device), output_metrics(bench, same)
                mm = [output_metrics(bench, m) for m in members]
                entry = worst.setdefault(name, {"msprobe": [0.0] * 4, "spread": [0.0] * 4, "widen": 0.0})
                for i, key in enumerate(keys):
                    dv, sv = getattr(md, key), getattr(ms, key)
                    ref = max([sv] + [getattr(m, key) for m in mm])
                    entry["msprobe"][i] = max(entry["msprobe"][i], dv / max(sv, floor))
                    entry["spread"][i] = max(entry["spread"][i], dv / max(ref, floor))
                entry["widen"] = max(entry["widen"], max(m.rmse for m in mm[:SPREAD_RUNS]) / max(ms.rmse, 1e-300))
        for name, e in worst.items():
            a = " ".join(f"{v:9.3g}" for v in e["msprobe"])
            b = " ".join(f"{v:8.3g}" for v in e["spread"])
            print(f"  {name:16s} {str(dtype)[6:]:9s} {a:>40s}   {b:>36s}   {e['widen']:.2f}")
    print("  (columns: small-value error ratio, RMSE, max relative error, mean relative error)")


def gelu_sweep() -> None:
    """A bias everywhere, judged by the benchmark standard: F.gelu scaled by 1 + 2^-K (TinyLM)."""
    variants = [("bfloat16", k) for k in (6, 7, 8)] + [("float32", k) for k in (12, 13, 14)]
    t0 = time.time()
    out = _run([["--model", "tinylm", "--dtype", dtype, "--case", "gelu_forward", "--second-device",
                 "--gelu-scale-log2", str(k)] for dtype, k in variants])
    for rank, (dtype, k) in enumerate(variants):
        found = flagged(out, rank, report_files.PRECISION_RESULT)
        hits = sorted(name for name, d in found if name.startswith("Functional.gelu.") and d == "forward")
        others = sorted(f for f in found if not f[0].startswith("Functional.gelu."))
        print(f"  {dtype} gelu x (1 + 2^-{k}): {len(hits)} of 2 calls caught" + (f", ALSO {others}" if others else ""))
    print(f"== gelu bias sweep ({time.time() - t0:.0f} s)")


def _pooled_variants() -> list[tuple[str, list[str], str, str]]:
    """(label, training arguments, the API whose forward is wrong, its dtype) of each variant of the sweep."""
    out = []
    for per_mille in (2, 5, 10, 20):
        out.append((f"mul 1 ULP on {per_mille / 10:g} %", ["--model", "convnet", "--dtype", "bfloat16", "--case",
                                                          "mul_ulp_1pct", "--fault-ulps", "1", "--fault-per-mille",
                                                          str(per_mille)], "Tensor.mul", "bfloat16"))
    for dtype, ks in (("bfloat16", (13, 14, 15, 16)), ("float16", (16, 17, 18, 19)), ("float32", (23, 24, 25, 26))):
        for k in ks:
            out.append((f"gelu x (1 + 2^-{k})", ["--model", "tinylm", "--dtype", dtype, "--case", "gelu_forward",
                                                 "--gelu-scale-log2", str(k)], "Functional.gelu", dtype))
    return out


def pooled_sweep(parallel: int = 2) -> None:
    """One server session per variant (the pooled test pools every rank of a session), `parallel` sessions at a
    time, 2 training steps each on the second device's background. Per call: the precision report flags the
    faulty API's forward; pooled: a finding (or error) on it in api_bias_{ts}.csv."""
    import concurrent.futures

    t0 = time.time()

    def one(variant):
        label, args, api, dtype = variant
        out = _run([args + ["--steps", "2", "--second-device"]])
        per_call = any(name.startswith(api + ".") and d == "forward"
                       for name, d in flagged(out, 0, report_files.PRECISION_RESULT))
        rows, _ = _pooled(out)
        row = next((r for r in rows if (r["api"], r["direction"], r["dtype"]) == (api, "forward", dtype)), None)
        others = sorted(f"{r['api']} {r['direction']} {r['dtype']}" for r in rows if r["verdict"] != "pass"
                        and r["api"] != api)
        return variant, per_call, row, others

    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(one, _pooled_variants()))
    print(f"== smallest bias found per call (precision report) and pooled across calls (api_bias), 2 steps, "
          f"{time.time() - t0:.0f} s")
    print(f"  {'variant':24s} {'dtype':9s} {'per call':9s} {'pooled':8s} {'bias (ULP)':>11s} {'detectable':>10s} "
          f"{'z':>7s} {'z thr':>6s}  elements")
    smallest: dict[tuple[str, str], tuple[float, str]] = {}
    for (label, _, _api, dtype), per_call, row, others in results:
        if row is None:
            print(f"  {label:24s} {dtype:9s} {'caught' if per_call else 'missed':9s} (not pooled)")
            continue
        bias = float(row["magnitude_bias_ulp"])
        print(f"  {label:24s} {dtype:9s} {'caught' if per_call else 'missed':9s} {row['verdict']:8s} "
              f"{bias:+11.4f} {float(row['detectable_ulp']):10.4f} {float(row['z_magnitude']):+7.1f} "
              f"{float(row['z_threshold']):6.2f}  {row['elements']}" + (f"  ALSO {others}" if others else ""))
        key = (label.split(" ")[0], dtype)
        if row["verdict"] != "pass" and (key not in smallest or bias < smallest[key][0]):
            smallest[key] = (bias, label)
    for (_family, dtype), (bias, label) in sorted(smallest.items()):
        print(f"  smallest found by the pooled test, {dtype}: {label} (bias in magnitude {bias:+.4f} ULP)")


def location_part(steps: int = 8) -> None:
    """5. What saying *where* costs on the training thread: the module path and source line of each captured call
    (npu_agent/location.py), TinyLM in bfloat16, capture only (bench/overhead.py's variants, timed in this process
    on one thread)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import overhead  # noqa: E402 - bench/overhead.py: the capture-only facades and the timed location
    import torch

    kwargs, batch, dtype = overhead.MODELS["tiny"]
    torch.manual_seed(0)
    model = overhead.TinyLM(dropout=0.1, **kwargs).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = list(overhead.batches(steps, batch=batch, seq=kwargs["seq"], vocab=kwargs["vocab"]))
    us, calls = overhead.location_cost(model, opt, data)
    located, bare = overhead._CaptureOnly(), overhead._CaptureOnly(locate=False)
    cpu = {"with": 0.0, "without": 0.0}
    for _ in range(3):   # interleaved: the difference includes the global module hooks
        cpu["with"] += overhead._round(model, opt, data, located)[0]
        cpu["without"] += overhead._round(model, opt, data, bare)[0]
    per_record = (cpu["with"] - cpu["without"]) / max(located.records, 1) * 1e6
    print("\n5. The module path and source line of each captured call (TinyLM, bfloat16, capture only, one thread)")
    print(f"  location.current(): {us:.1f} us per captured call ({calls} calls, caches warm)")
    print(f"  capture with location - without, whole training thread (module hooks included): {per_record:+.1f} us "
          f"per record ({located.records} records; noisy on a shared machine)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--only-measure", action="store_true", help="only the in-process spread measurements")
    p.add_argument("--gelu-sweep", action="store_true", help="also sweep a gelu bias (benchmark standard)")
    p.add_argument("--skip-measure", action="store_true", help="skip the in-process spread measurements")
    p.add_argument("--skip-faults", action="store_true", help="skip the faults of tests/faulty_kernels.py")
    p.add_argument("--skip-pooled", action="store_true", help="skip the pooled test's sweep (4.)")
    p.add_argument("--skip-location", action="store_true", help="skip the cost of module path and source line (5.)")
    ns = p.parse_args()
    if not ns.skip_location:
        location_part()
    if not ns.skip_measure:
        measure_spread()
    if ns.only_measure:
        return
    clean_runs(ns.seeds)
    if not ns.skip_faults:
        fault_runs()
    if not ns.skip_sweep:
        sweep()
    if ns.gelu_sweep:
        gelu_sweep()
    if not ns.skip_pooled:
        pooled_sweep()


if __name__ == "__main__":
    main()
