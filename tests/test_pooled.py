"""Judging across calls (gpu_server/checking/pooled.py, docs/pooled.md): the device's error against the bench pooled per
API,
direction and dtype over the run, tested for a signed bias, a bias in magnitude and a wider spread than the host's
same-dtype run.

Unit tests on synthetic tensors (a correct device = another correct rounding of the bench; faults = 1 % of the
elements one ULP up, a scale of 1 + 2^-8 before rounding), the false-alarm bound on 200 synthetic unbiased runs, the
checker's integration, and (slow) real trainings against real servers: the two faults on the second, correct device
(tests/second_device.py) are found on their API only, and the correct device over 3 seeds x 3 dtypes gives nothing.
"""
from __future__ import annotations

import csv
import glob
import json
import math
import os
import threading

import pytest
import torch
import torch.nn.functional as F

from gpu_server.checking import pooled as pooled_mod
from gpu_server.checking.pooled import COLUMNS, DEFAULT_FAIL_ABOVE_ULP, PooledErrors, z_threshold

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# a perturbation below one ULP before rounding (another accumulation order): about a quarter ULP
JITTER = {torch.bfloat16: 2.0 ** -10, torch.float16: 2.0 ** -13, torch.float32: 2.0 ** -26}


def _bench(gen: torch.Generator, dtype: torch.dtype, shape=(64, 32), scale: float = 3.0) -> torch.Tensor:
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(wide)


def _other_rounding(b: torch.Tensor, dtype: torch.dtype, gen: torch.Generator, rows: bool = False) -> torch.Tensor:
    """A correct device: round to nearest after an unbiased perturbation below one ULP, per element or (rows) one
    per row of the last dimension (a row-wise statistic computed in another order)."""
    shape = (*b.shape[:-1], 1) if rows else b.shape
    delta = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * JITTER[dtype]
    return (b.double() * (1 + delta)).to(dtype)


def _one_ulp_up(x: torch.Tensor, per_mille: int = 10) -> torch.Tensor:
    """tests/faulty_kernels.py's mul fault: the bit pattern raised by one (one ULP up in magnitude) on per_mille of
    1000 elements."""
    x = x.contiguous()
    index = torch.arange(x.numel()).reshape(x.shape)
    chosen = (torch.remainder(index * 2654435761, 1000) < per_mille) & (x != 0)
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[x.dtype]
    bits = x.view(ints)
    return torch.where(chosen, bits + 1, bits).view(x.dtype)


def _row(p: PooledErrors, api: str = "Tensor.mul", direction: str = "forward") -> dict:
    rows = [r for r in p.rows() if r["api"] == api and r["direction"] == direction]
    assert len(rows) == 1, p.rows()
    return rows[0]


def _pool(device_fn, dtype=torch.bfloat16, calls: int = 4, seed: int = 0, shape=(64, 32), **kw) -> PooledErrors:
    gen = torch.Generator().manual_seed(seed)
    p = PooledErrors(**kw)
    for _ in range(calls):
        b = _bench(gen, dtype, shape)
        p.observe("Tensor.mul", "forward", b, device_fn(b, dtype, gen), b.to(dtype))
    return p


# -- the statistics on synthetic tensors ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unbiased_rounding_passes_over_many_seeds(dtype):
    for seed in range(20):
        for rows in (False, True):
            r = _row(_pool(lambda b, dt, g, rows=rows: _other_rounding(b, dt, g, rows), dtype, seed=seed))
            assert r["differing_elements"] > 100     # the test had something to judge
            assert r["verdict"] == "pass", r
            assert 0.5 < r["spread_ratio"] < 2.0


def test_bit_identical_device_passes_and_counts_no_test():
    p = _pool(lambda b, dt, g: b.to(dt))
    r = _row(p)
    assert r["verdict"] == "pass" and r["differing_elements"] == 0 and r["p_bias"] == 1.0
    assert p.as_dict()["tests"] == 1            # no informative group: the threshold of a single test


def test_one_percent_of_elements_one_ulp_up_is_found():
    p = _pool(lambda b, dt, g: _one_ulp_up(b.to(dt)))
    r = _row(p)
    assert r["verdict"] != "pass", r
    assert 0.008 < r["magnitude_bias_ulp"] < 0.013
    assert r["z_magnitude"] > r["z_threshold"]
    # on data of both signs the signed mean stays small: only the magnitude statistic sees it
    assert abs(r["z_bias"]) < r["z_threshold"]
    assert "magnitude" in r["reason"]
    # 0.01 ULP is above the default limit: an error; with a higher limit the same evidence is a finding
    assert r["verdict"] == "error" and DEFAULT_FAIL_ABOVE_ULP < 0.01
    assert _row(_pool(lambda b, dt, g: _one_ulp_up(b.to(dt)), fail_above_ulp=0.05))["verdict"] == "finding"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_before_rounding_is_found(dtype):
    r = _row(_pool(lambda b, dt, g: (b.double() * (1 + 2.0 ** -8)).to(dt), dtype))
    assert r["verdict"] == "error", r
    # 2^-8 relative is 0.5 to 1 ULP of bfloat16, 2 to 4 of float16, 2^15 of float32 (clipped at CLIP_ULP)
    assert r["magnitude_bias_ulp"] > 0.4
    assert r["z_magnitude"] > r["z_threshold"]


def test_one_sided_signed_bias_is_found():
    """Rounding up instead of to nearest on half of the elements: a signed bias of about +0.25 ULP."""
    def up(b, dt, g):
        d = b.to(dt)
        below = (d.to(b.dtype) < b) & (torch.rand(b.shape, generator=g) < 0.5)
        return torch.where(below, torch.nextafter(d, torch.full_like(d, math.inf)), d)

    r = _row(_pool(up))
    assert r["verdict"] == "error" and r["z_bias"] > r["z_threshold"] and 0.05 < r["bias_ulp"] < 0.5, r


def test_wider_spread_is_a_finding():
    """Noise of several ULP on every element, unbiased: only the spread statistic sees it (never an error)."""
    def noisy(b, dt, g):
        return (b.double() * (1 + (torch.rand(b.shape, generator=g, dtype=torch.float64) * 2 - 1) * 2.0 ** -5)).to(dt)

    r = _row(_pool(noisy))
    assert r["spread_ratio"] > 4 and r["z_spread"] > r["z_threshold"]
    assert r["verdict"] == "finding" and "spread" in r["reason"], r


def test_false_alarm_bound_on_200_unbiased_runs():
    """200 synthetic runs of a correct device (3 dtypes, element-wise and row-wise perturbations, 12 outputs each):
    no finding at all (the bound is 1e-6 per run; the largest |z| stays far below the threshold)."""
    worst = 0.0
    for seed in range(200):
        gen = torch.Generator().manual_seed(1000 + seed)
        p = PooledErrors()
        for dtype in DTYPES:
            for call in range(4):
                b = _bench(gen, dtype, (32, 64))
                rows = call % 2 == 1
                p.observe(f"api{call % 2}", "forward", b, _other_rounding(b, dtype, gen, rows), b.to(dtype))
        rows = p.rows()
        assert [r for r in rows if r["verdict"] != "pass"] == []
        worst = max(worst, max(max(abs(r["z_bias"]), abs(r["z_magnitude"]), r["z_spread"]) for r in rows))
    assert worst < rows[0]["z_threshold"] - 1, worst


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_row_correlated_errors_of_a_correct_device_are_no_finding(dtype):
    """A layer_norm-like device: each row scaled by its own (1 + delta), delta of either sign, about one ULP of
    float32: the errors of a row share their sign in magnitude. The element-level variance alone would make the
    magnitude statistic several standard errors off; the row-grouped variance keeps it in bounds."""
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        p = PooledErrors()
        for _ in range(4):
            b = _bench(gen, dtype, (128, 32))
            delta = (torch.rand(128, 1, generator=gen, dtype=torch.float64) * 2 - 1) * 4 * JITTER[dtype]
            p.observe("Functional.layer_norm", "forward", b, (b.double() * (1 + delta)).to(dtype), b.to(dtype))
        r = _row(p, "Functional.layer_norm")
        assert r["verdict"] == "pass", r
        assert abs(r["z_magnitude"]) < 5


def test_a_biased_same_dtype_run_is_not_the_devices_finding():
    """The host's float32 kernel is the biased one (CPU gelu in float32: about +0.4 ULP): the device, correctly
    rounded, is no further from the bench. A pass with a note, never a finding of the device."""
    gen = torch.Generator().manual_seed(0)
    p = PooledErrors()
    for _ in range(4):
        b = _bench(gen, torch.float32, (64, 64))
        host = torch.where(torch.rand(b.shape, generator=gen) < 0.4,
                           torch.nextafter(b.float(), torch.full(b.shape, math.inf)), b.float())
        p.observe("Functional.gelu", "forward", b, b.to(torch.float32), host)
    r = _row(p, "Functional.gelu")
    assert abs(r["z_bias"]) > r["z_threshold"]             # the paired difference is significant ...
    assert r["verdict"] == "pass", r                       # ... but it is the same-dtype run's bias
    assert "the same-dtype run, not the device" in r["reason"]


def test_what_is_ignored():
    p = PooledErrors()
    b = torch.randn(8, 8)
    p.observe("a.int", "forward", torch.arange(4), torch.arange(4), torch.arange(4))
    p.observe("a.shape", "forward", b, b.bfloat16()[:4], b.bfloat16()[:4])
    p.observe("a.empty", "forward", b[:0], b[:0].bfloat16(), b[:0].bfloat16())
    p.observe("a.f64", "forward", b.double(), b.double(), b.double())
    p.observe("a.same_none", "forward", b, b.bfloat16(), None)
    p.observe("a.narrow_bench", "forward", b.bfloat16(), b.bfloat16(), b.bfloat16())
    p.observe("a.complex", "forward", torch.randn(4, dtype=torch.complex128), torch.randn(4, dtype=torch.complex64),
              torch.randn(4, dtype=torch.complex64))
    p.observe("a.scalar", "forward", 1.0, 1.0, 1.0)
    assert p.rows() == []
    # elements: not finite on a side, or a bench outside the device dtype's normal range, are left out
    bench = torch.tensor([1.0, 2.0, float("nan"), 1e-40, 70000.0, 3.0, 4.0, float("inf")])
    device = torch.tensor([1.0, float("inf"), 1.0, 0.0, 65504.0, 3.0, 4.0, 1.0]).half()
    p.observe("Tensor.add", "forward", bench, device, bench.half())
    r = _row(p, "Tensor.add")
    assert r["elements"] == 3 and r["elements_seen"] == 8


def test_large_outputs_are_subsampled_with_a_fixed_stride():
    b = torch.randn(1 << 16)
    p = PooledErrors(max_elements=1 << 12)
    p.observe("Tensor.mul", "forward", b, b.bfloat16(), b.bfloat16())
    r = _row(p)
    assert r["elements"] == 1 << 12 and r["elements_seen"] == 1 << 16


def test_thresholds_follow_the_number_of_tests():
    assert z_threshold(1e-6, 1) == pytest.approx(4.8916, abs=1e-3)       # two-sided 1e-6
    assert z_threshold(1e-6, 300) > z_threshold(1e-6, 30) > z_threshold(1e-6, 3)
    p = PooledErrors()
    gen = torch.Generator().manual_seed(0)
    for api in ("a", "b", "c"):
        b = _bench(gen, torch.bfloat16)
        p.observe(api, "forward", b, _other_rounding(b, torch.bfloat16, gen), b.bfloat16())
    d = p.as_dict()
    assert d["tests"] == 9     # three statistics for each of the three informative groups
    for r in d["apis"]:
        assert r["z_threshold"] == pytest.approx(z_threshold(1e-6, 9), rel=1e-5)
        assert r["detectable_ulp"] >= r["z_threshold"] ** 2 / r["elements"] * (1 - 1e-5)


def test_as_dict_and_csv(tmp_path):
    p = _pool(lambda b, dt, g: _one_ulp_up(b.to(dt)))
    b = torch.randn(16, 16)
    p.observe("Functional.gelu", "backward", b, b.half(), b.half(), output_index=1)
    exact = torch.linspace(1, 2, 65, dtype=torch.float64)[:64].float()    # exactly representable in float16
    off = exact.half().clone()
    off[0] += 2.0 ** -8                                                    # one element 4 ULP off: not significant
    p.observe("Tensor.add", "forward", exact, off, exact.half())
    d = json.loads(json.dumps(p.as_dict(), allow_nan=False))   # strict JSON: an infinite spread ratio is null
    assert d["false_alarm_rate_per_api"] == 1e-6 and d["fail_above_ulp"] == DEFAULT_FAIL_ABOVE_ULP
    assert [(r["api"], r["direction"], r["dtype"]) for r in d["apis"]] == [
        ("Functional.gelu", "backward", "float16"), ("Tensor.add", "forward", "float16"),
        ("Tensor.mul", "forward", "bfloat16")]
    assert set(d["apis"][0]) == set(COLUMNS)
    assert d["apis"][1]["spread_ratio"] is None and d["apis"][1]["elements"] == 64
    d["apis"].pop(1)
    assert [r["api"] for r in d["findings"]] == ["Tensor.mul"]
    assert d["apis"][1]["calls"] == 4 and d["apis"][1]["outputs"] == 4
    path = p.write_csv(str(tmp_path), "20260101000000")
    assert os.path.basename(path) == "api_bias_20260101000000.csv"
    raw = open(path, "rb").read()
    assert raw.startswith("\ufeff".encode()) and not os.path.exists(path + ".tmp")
    with open(path, encoding="utf-8-sig", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(COLUMNS)
    assert [(r["api"], r["verdict"]) for r in rows] == [("Functional.gelu", "pass"), ("Tensor.add", "pass"),
                                                         ("Tensor.mul", "error")]
    assert rows[1]["spread_ratio"] == "inf"
    assert float(rows[2]["magnitude_bias_ulp"]) == pytest.approx(d["apis"][1]["magnitude_bias_ulp"], rel=1e-4)


def test_observe_is_thread_safe():
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(16):
        b = _bench(gen, torch.bfloat16)
        data.append((b, _other_rounding(b, torch.bfloat16, gen), b.bfloat16()))
    one = PooledErrors()
    for b, d, s in data * 4:
        one.observe("Tensor.mul", "forward", b, d, s)
    many = PooledErrors()
    threads = [threading.Thread(target=lambda: [many.observe("Tensor.mul", "forward", *x) for x in data])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = _row(one), _row(many)
    assert a["elements"] == b["elements"] == 4 * 16 * 64 * 32 and a["outputs"] == b["outputs"] == 64
    for key in ("bias_ulp", "magnitude_bias_ulp", "spread_ratio", "z_bias", "z_magnitude"):
        assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12)


# -- the checker's integration ----------------------------------------------------------------------------------
def _captured_gelu_calls(scale: float):
    from tests.support import capture

    with capture() as (mode, sink):
        for seed in range(4):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(64, 64, generator=gen).bfloat16().requires_grad_()
            with mode:
                y = F.gelu(x)
            y.float().sum().backward()
    for rec in sink:
        if rec.name.startswith("Functional.gelu.") and rec.direction == 1:
            rec.output.tree = (rec.output.tree.double() * scale).bfloat16()   # a device whose gelu is scaled
    return sink


def _worker(out, pooled: PooledErrors):
    """One server worker, in this thread, whose checker pools into `pooled`."""
    from gpu_server.checking.checker import Checker
    from gpu_server.checking.pending import PendingCalls
    from gpu_server.checking.workers import Worker
    from gpu_server.reports.rank_reports import Reports
    from gpu_server.reports.summary import Summary

    summary = Summary()
    return Worker(Checker(torch.device("cpu"), summary, pooled=pooled),
                  Reports(str(out), "20260101000000", summary.add_files), PendingCalls(4 << 30))


def test_checker_pools_every_compared_output(tmp_path):
    from tests.support import to_job

    pool = PooledErrors()
    worker = _worker(tmp_path, pool)
    for rec in _captured_gelu_calls(1 + 2.0 ** -8):
        worker.check(to_job(rec))
    worker.close()
    r = _row(pool, "Functional.gelu", "forward")
    assert r["calls"] == 4 and r["elements"] == 4 * 64 * 64 and r["verdict"] == "error"
    assert _row(pool, "Functional.gelu", "backward")["verdict"] == "pass"


def test_a_failing_pool_never_fails_a_row(tmp_path, caplog):
    from tests.support import read_csv, to_job

    class Broken(PooledErrors):
        calls = 0

        def observe(self, *args, **kwargs):
            Broken.calls += 1
            raise RuntimeError("broken pool")

    worker = _worker(tmp_path, Broken())
    for rec in _captured_gelu_calls(1.0):
        worker.check(to_job(rec))
    worker.close()
    rows = read_csv(str(tmp_path), "accuracy_checking_result")
    assert len(rows) == 4 and all(r["Forward Test Success"] == "pass" for r in rows)
    assert Broken.calls >= 8
    assert sum("could not be pooled" in r.message for r in caplog.records) == 1   # logged once


def test_server_option_bias_fail_ulp(tmp_path):
    from gpu_server import cli
    from tests.support import server_config

    assert cli._args(["--config", "x"]).bias_fail_ulp is None
    assert cli._args(["--config", "x", "--bias-fail-ulp", "0.05"]).bias_fail_ulp == 0.05
    config = server_config(str(tmp_path / "server.json"))
    assert cli.main(["--config", config, "--out", str(tmp_path / "out"), "--bias-fail-ulp", "-1"]) == 2


def test_module_defaults_are_documented():
    text = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "pooled.md"), encoding="utf-8").read()
    assert f"{pooled_mod.DEFAULT_FAIL_ABOVE_ULP:g}" in text and "1e-6" in text
    for column in COLUMNS:
        assert f"`{column}`" in text, column


# -- real trainings against real servers ------------------------------------------------------------------------
FAULTS = [
    # 1 % of bfloat16 Tensor.mul outputs one ULP up (ConvNet: the demo model has no Tensor.mul)
    ["--model", "convnet", "--dtype", "bfloat16", "--steps", "2", "--second-device", "--case", "mul_ulp_1pct",
     "--fault-ulps", "1", "--fault-per-mille", "10"],
    # F.gelu scaled by 1 + 2^-8 before rounding (the demo model, TinyLM)
    ["--model", "tinylm", "--dtype", "bfloat16", "--steps", "2", "--second-device", "--case", "gelu_forward",
     "--gelu-scale-log2", "8"],
]
CLEAN = [["--model", "tinylm", "--dtype", dtype, "--seed", str(seed), "--second-device"]
         for seed in range(3) for dtype in ("float32", "bfloat16", "float16")]


def _serve(tmp_path_factory, sessions: dict[str, list[list[str]]]) -> dict[str, str]:
    """One real server per session, the sessions at the same time (the host has 2 cores); each session's trainings
    are concurrent ranks of it. Returns each session's --out."""
    from tests import support
    from tests.faulty_kernels import run_trainings

    servers = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")   # the same-dtype run uses the trainings' thread count
        for name in sessions:
            servers[name] = support.Server(str(tmp_path_factory.mktemp(name))).start()
    failures: dict[str, BaseException] = {}

    def train(name: str) -> None:
        server = servers[name]
        try:
            run_trainings(support.agent_config(os.path.join(server.workdir, "agent.json"), server.port),
                          sessions[name])
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after every server has stopped
            failures[name] = exc

    threads = [threading.Thread(target=train, args=(name,)) for name in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = {name: server.stop() for name, server in servers.items()}
    for name, exc in failures.items():
        raise AssertionError(f"session {name} failed") from exc
    for name, code in codes.items():
        assert code == 0, servers[name].log()
    return {name: server.out for name, server in servers.items()}


@pytest.fixture(scope="module")
def outs(tmp_path_factory) -> dict[str, str]:
    return _serve(tmp_path_factory, {"pooled_faults": FAULTS, "pooled_clean": CLEAN})


@pytest.fixture
def fault_out(outs) -> str:
    return outs["pooled_faults"]


@pytest.fixture
def clean_out(outs) -> str:
    return outs["pooled_clean"]


def _read(out: str) -> tuple[list[dict], dict]:
    (csv_path,) = glob.glob(os.path.join(out, "api_bias_*.csv"))
    with open(csv_path, encoding="utf-8-sig", newline="") as fh:
        rows = list(csv.DictReader(fh))
    (summary_path,) = glob.glob(os.path.join(out, "summary_*.json"))
    with open(summary_path, encoding="utf-8") as fh:
        summary = json.load(fh)
    return rows, summary


@pytest.mark.slow
def test_each_fault_is_found_on_its_api_only(fault_out):
    rows, summary = _read(fault_out)
    found = {(r["api"], r["direction"], r["dtype"]) for r in rows if r["verdict"] != "pass"}
    required = {("Tensor.mul", "forward", "bfloat16"), ("Functional.gelu", "forward", "bfloat16")}
    allowed = required | {("Tensor.mul", "backward", "bfloat16")}   # mul's backward uses mul
    assert required <= found <= allowed, found
    by_key = {(r["api"], r["direction"], r["dtype"]): r for r in rows}
    gelu, mul = by_key[("Functional.gelu", "forward", "bfloat16")], by_key[("Tensor.mul", "forward", "bfloat16")]
    assert float(gelu["magnitude_bias_ulp"]) > 0.3 and gelu["verdict"] == "error"
    assert 0.005 < float(mul["magnitude_bias_ulp"]) < 0.03 and float(mul["z_magnitude"]) > float(mul["z_threshold"])
    # the summary JSON carries the same (gpu_server/reports/summary.py: "api_bias")
    bias = summary["api_bias"]
    assert bias["false_alarm_rate_per_api"] == 1e-6 and bias["tests"] >= 3
    assert {(f["api"], f["direction"], f["dtype"]) for f in bias["findings"]} == found
    assert len(bias["apis"]) == len(rows)


@pytest.mark.slow
def test_the_gelu_bias_passes_every_single_call(fault_out):
    """What the pooled test adds: F.gelu x (1 + 2^-8) fails no call of the precision report (msprobe's ratio floor
    of 2^-8 hides it, docs/standards.md)."""
    from tests.faulty_kernels import flagged

    assert not {c for c in flagged(fault_out, 1, "api_precision_compare_result")
                if c[0].startswith("Functional.gelu.")}


@pytest.mark.slow
def test_correct_second_device_gives_no_finding(clean_out):
    rows, summary = _read(clean_out)
    assert {r["dtype"] for r in rows} >= {"float32", "bfloat16", "float16"}
    assert sum(int(r["differing_elements"]) > 0 for r in rows) >= 10     # the correct device does differ
    assert [(r["api"], r["direction"], r["dtype"], r["reason"]) for r in rows if r["verdict"] != "pass"] == []
    assert summary["api_bias"]["findings"] == []
