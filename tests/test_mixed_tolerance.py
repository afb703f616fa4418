"""The mixed-tolerance standard (Ascend 2026), the quantisation standard, the benchmark standard's tiers, per-API
judging (selection.configure) and float8 outputs (docs/standards.md). Expected values are worked out in comments."""
import csv
import os

import pytest
import torch

from gpu_server.columns import EXTRA_COLUMNS, PRECISION_DETAILS_HEADER, PRECISION_EXTRA_COLUMNS
from gpu_server.judging.metrics import OutputMetrics, analyse
from gpu_server.judging.standards import STANDARD_REGISTRY
from gpu_server.judging.standards.judging import judge
from gpu_server.judging.standards.registry import StandardInput
from gpu_server.judging.standards.selection import (
    ApiJudging,
    configure,
    configured,
    known_standards,
    select_standard,
    threshold_names,
)
from gpu_server.judging.standards.thresholds import THRESHOLDS
from gpu_server.judging.verdict import compare_output

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RATE, MAX_RATIO, STATUS = PRECISION_EXTRA_COLUMNS[:3]
Q_MAX, Q_STATUS = PRECISION_EXTRA_COLUMNS[3:]


@pytest.fixture(autouse=True)
def _reset():
    configure({})
    yield
    configure({})


def mixed(bench, device, api="Functional.gelu"):
    """Judge with the mixed-tolerance standard selected for `api`."""
    configure({api: ApiJudging(standard="mixed_tolerance")})
    category, name = api.split(".", 1)
    return judge(name, bench, device, category=category)


def ones_with(n, dtype, changes=(), bench_value=1.0):
    bench = torch.full((n,), bench_value, dtype=torch.float64)
    device = bench.to(dtype)
    for i, v in changes:
        device[i] = v
    return bench, device


# ---- the table -----------------------------------------------------------------------------------------------------

def test_constants_table():
    t = THRESHOLDS.mixed_tolerance
    assert (t[F16].atol, t[F16].rtol) == (2.0 ** -9, 2.0 ** -9)
    assert (t[BF16].atol, t[BF16].rtol) == (2.0 ** -6, 2.0 ** -6)
    assert (t[F32].atol, t[F32].rtol) == (2.0 ** -16, 2.0 ** -10)
    assert (t[E4M3].atol, t[E4M3].rtol) == (2.0 ** -4, 2.0 ** -2)
    # e5m2 by e4m3's rule: atol = eps / 2, rtol = 2 eps (e4m3: eps 2^-3 -> 2^-4, 2^-2; e5m2: eps 2^-2)
    eps = torch.finfo(E5M2).eps
    assert (t[E5M2].atol, t[E5M2].rtol, t[E5M2].derived) == (eps / 2, 2 * eps, True)
    assert torch.finfo(E4M3).eps / 2 == t[E4M3].atol and 2 * torch.finfo(E4M3).eps == t[E4M3].rtol
    assert all(c.floor == c.atol for c in t.values())
    assert (THRESHOLDS.mixed_pass_rate, THRESHOLDS.mixed_max_ulp) == (0.99, 32.0)


# ---- the 99 % edge: elements outside atol + rtol |g| but within 32 ULP ----------------------------------------------
# at g = 1: float16 tolerance 2^-9 + 2^-9 = 2^-8, ULP 2^-10, an error of 8 ULP = 2^-7 fails the element, not the max;
# bfloat16 2^-5, ULP 2^-7, error 2^-4; e4m3 2^-4 + 2^-2 = 0.3125, ULP 2^-3, error 0.5; e5m2 0.625, ULP 2^-2, error 1.
OUTSIDE = {F16: 1 + 2.0 ** -7, BF16: 1 + 2.0 ** -4, E4M3: 1.5, E5M2: 2.0}


@pytest.mark.parametrize("dtype", list(OUTSIDE))
def test_pass_rate_edge(dtype):
    value = OUTSIDE[dtype]
    assert float(torch.tensor(value).to(dtype).float()) == value   # representable
    r = mixed(*ones_with(1000, dtype, [(i, value) for i in range(10)]))   # 990 / 1000 = 0.99: pass
    assert (r.status, r.cells[RATE], r.cells[STATUS]) == ("pass", 0.99, "pass")
    assert r.cells[MAX_RATIO] <= 1
    r = mixed(*ones_with(1000, dtype, [(i, value) for i in range(11)]))   # 0.989
    assert (r.status, r.cells[RATE], r.cells[STATUS]) == ("error", 0.989, "error")
    assert "通过率" in r.message


@pytest.mark.parametrize("dtype, at, beyond", [
    (F16, 1 + 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -10),       # atol + rtol |1| = 2^-8 exactly: in (<=)
    (BF16, 1 + 2.0 ** -5, 1 + 2.0 ** -5 + 2.0 ** -7),
    (F32, 1 + 2.0 ** -23, 1 + 2.0 ** -23),                    # (float32: see test_float32_max_rule_binds)
])
def test_elementwise_boundary_is_inclusive(dtype, at, beyond):
    r = mixed(*ones_with(100, dtype, [(i, at) for i in range(100)]))
    assert r.cells[RATE] == 1.0
    if beyond != at:
        r = mixed(*ones_with(100, dtype, [(i, beyond) for i in range(100)]))
        assert r.cells[RATE] == 0.0 and r.status == "error"


# ---- the 32-ULP edge of the largest error ---------------------------------------------------------------------------
# one element of 1000 (the pass rate stays 0.999): error exactly 32 ULP passes, the next device value fails.
# g = 1: float16 ULP(1) 2^-10, bfloat16 2^-7: 1 + 32 ULP and 1 + 33 ULP are representable. float32 at g = 8 (ULP
# 2^-20; at 1, 32 ULP = 2^-18 is below the floor 2^-16). float8 at g = 1: e4m3 32 ULP = 4 (device -3; next -3.25),
# e5m2 32 ULP = 8 (device -7; next -8).
EDGES = {F16: (1.0, 1 + 32 * 2.0 ** -10, 1 + 33 * 2.0 ** -10), BF16: (1.0, 1 + 32 * 2.0 ** -7, 1 + 33 * 2.0 ** -7),
         F32: (8.0, 8 + 32 * 2.0 ** -20, 8 + 33 * 2.0 ** -20), E4M3: (1.0, -3.0, -3.25), E5M2: (1.0, -7.0, -8.0)}


@pytest.mark.parametrize("dtype", list(EDGES))
def test_max_error_32_ulp_edge(dtype):
    g, at, beyond = EDGES[dtype]
    r = mixed(*ones_with(1000, dtype, [(500, at)], bench_value=g))
    assert (r.status, r.cells[MAX_RATIO]) == ("pass", 1.0)
    r = mixed(*ones_with(1000, dtype, [(500, beyond)], bench_value=g))
    assert r.status == "error" and r.cells[MAX_RATIO] > 1 and r.cells[RATE] >= 0.999   # float32: 1.0
    assert "最大误差" in r.message


@pytest.mark.parametrize("dtype, step", [(F16, 2.0 ** -19), (BF16, 2.0 ** -13), (F32, 2.0 ** -39)])
def test_max_error_floor_at_zero(dtype, step):
    # bench 0: 32 ULP is 32 subnormal steps; the floor (atol: float16 2^-9, bfloat16 2^-6, float32 2^-16) allows more
    atol = THRESHOLDS.mixed_tolerance[dtype].atol
    r = mixed(*ones_with(1000, dtype, [(0, atol)], bench_value=0.0))
    assert (r.status, r.cells[MAX_RATIO]) == ("pass", 1.0)
    r = mixed(*ones_with(1000, dtype, [(0, atol + step)], bench_value=0.0))
    assert r.status == "error" and r.cells[MAX_RATIO] > 1


def test_float32_max_rule_binds():
    # float32: rtol 2^-10 is wider than 32 ULP (2^-18 at 1): the largest-error rule decides
    r = mixed(*ones_with(1000, F32, [(0, 1 + 2.0 ** -12)]))
    assert r.cells[RATE] == 1.0 and r.status == "error"


def test_non_finite_must_match():
    inf, nan = float("inf"), float("nan")
    bench = torch.tensor([inf, -inf, nan, 1.0, 70000.0], dtype=torch.float64)   # 70000: inf in float16
    device = torch.tensor([inf, -inf, nan, 1.0, inf], dtype=F16)
    r = mixed(bench, device)
    assert (r.status, r.cells[RATE]) == ("pass", 1.0)
    for i, wrong in ((0, -inf), (1, nan), (2, 1.0), (3, inf), (4, 65504.0)):
        d = device.clone()
        d[i] = wrong
        r = mixed(bench, d)
        assert r.status == "error" and "inf或nan不一致" in r.message, (i, wrong)


def test_empty_and_without_tensors():
    r = mixed(torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=F16))
    assert (r.status, r.cells[RATE]) == ("pass", 1.0)
    # the offline comparison has metrics only: SKIP
    res = STANDARD_REGISTRY["mixed_tolerance"].judge(StandardInput(F16, OutputMetrics(), None))
    assert res.status == "SKIP"


def test_threshold_override():
    bench, device = ones_with(100, F16, [(i, 1 + 2.0 ** -7) for i in range(100)])
    assert mixed(bench, device).status == "error"
    configure({"Functional.gelu": ApiJudging("mixed_tolerance", thresholds={"float16": {"rtol": 2.0 ** -6}})})
    assert judge("gelu", bench, device, category="Functional").status == "pass"
    configure({"Functional.gelu": ApiJudging("mixed_tolerance", thresholds={"float16": {"pass_rate": 0.0}})})
    assert judge("gelu", bench, device, category="Functional").status == "pass"


# ---- float8 -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_default_is_mixed_tolerance(dtype):
    assert select_standard("gelu", dtype) == "mixed_tolerance"
    assert select_standard("mm", dtype) == "mixed_tolerance"
    assert select_standard("relu", dtype) == "binary"        # exact ops stay exact
    g = torch.Generator().manual_seed(0)
    bench = torch.randn(4096, generator=g, dtype=torch.float64) * 3
    device = bench.to(dtype)                                  # correct rounding
    r = judge("gelu", bench, device)
    assert (r.status, r.algorithm) == ("pass", "混合容差比对法"), r.message
    planted = device.clone()
    planted[:60] = (bench[:60] * 2 + 1).to(dtype)             # 60 of 4096 elements (1.5 %) far out
    assert judge("gelu", bench, planted).status == "error"
    one = device.clone()
    one[7] = torch.tensor(bench[7].item() + 100.0).to(dtype)  # one element beyond 32 ULP
    r = judge("gelu", bench, one)
    assert r.status == "error" and r.cells[RATE] > 0.99


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("standard", ["absolute", "ulp", "benchmark", "binary", "thousandth"])
def test_fp8_every_standard_judges(dtype, standard):
    g = torch.Generator().manual_seed(1)
    bench = torch.randn(3000, generator=g, dtype=torch.float64)
    device = bench.to(dtype)
    configure({"Functional.gelu": ApiJudging(standard=standard)})
    r = judge("gelu", bench, device, same=device.clone(), category="Functional")
    assert r.status == "pass"    # bit-identical to the same-dtype run at least
    r = judge("gelu", bench, device, category="Functional")   # no same-dtype run
    if standard in ("absolute", "ulp"):
        # correct rounding: relative error <= eps / 2 < rtol = eps; ULP error <= 0.5
        assert r.status == "pass", r.message
    assert compare_output(bench, device).status in ("pass", "Warning", "error")   # the two-way status runs


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_metrics(dtype):
    bench = torch.tensor([1.0, 0.3, -2.0, 0.0, 1e-3], dtype=torch.float32)
    m = analyse(bench, bench.to(dtype)).metrics
    assert 0 < m.ulp_max <= 0.5 and m.max_rel_err <= torch.finfo(dtype).eps / 2
    assert m.binary_error_rate > 0
    row = THRESHOLDS.for_dtype(dtype)
    info = torch.finfo(dtype)
    assert (row.small_value, row.rtol, row.ratio_floor) == (info.smallest_normal, info.eps, info.eps / 2)
    assert row.small_atol == info.smallest_normal * info.eps      # the subnormal spacing
    assert 2.0 ** row.ulp_min_exponent == info.smallest_normal and 2.0 ** -row.ulp_precision == info.eps


# ---- quantisation -------------------------------------------------------------------------------------------------

def test_quantisation_rule():
    bench = torch.tensor([0, 5, -7, 127, -128], dtype=torch.int8)
    off_by_one = torch.tensor([1, 4, -7, 126, -127], dtype=torch.int8)
    off_by_two = torch.tensor([2, 5, -7, 127, -128], dtype=torch.int8)
    # built-in choice for integer outputs: binary consistency
    assert judge("npu_quantize", bench, off_by_one, category="NPU").status == "error"
    configure({"NPU.npu_quantize": ApiJudging(standard="quantisation")})
    r = judge("npu_quantize", bench, off_by_one, category="NPU")
    assert (r.status, r.algorithm, r.cells[Q_MAX], r.cells[Q_STATUS]) == ("pass", "量化比对法", 1.0, "pass")
    r = judge("npu_quantize", bench, off_by_two, category="NPU")
    assert (r.status, r.cells[Q_MAX]) == ("error", 2.0) and "1 of 5" in r.message
    configure({"NPU.npu_quantize": ApiJudging("quantisation", thresholds={"int8": {"max_diff": 2}})})
    assert judge("npu_quantize", bench, off_by_two, category="NPU").status == "pass"
    # another API with the same name in another category is not configured
    assert judge("npu_quantize", bench, off_by_one, category="Torch").status == "error"


def test_quantisation_on_float_and_uint8():
    configure({"Torch.fake_quantize_per_tensor_affine": ApiJudging(standard="quantisation")})
    bench = torch.tensor([3.0, -2.0, float("nan")], dtype=torch.float64)
    r = judge("fake_quantize_per_tensor_affine", bench, torch.tensor([4.0, -2.0, float("nan")]), category="Torch")
    assert r.status == "pass"
    r = judge("fake_quantize_per_tensor_affine", bench, torch.tensor([3.0, -2.0, 0.0]), category="Torch")
    assert r.status == "error"
    b8 = torch.tensor([0, 255], dtype=torch.uint8)
    assert judge("fake_quantize_per_tensor_affine", b8, torch.tensor([1, 254], dtype=torch.uint8),
                 category="Torch").status == "pass"


# ---- benchmark tiers ---------------------------------------------------------------------------------------------

def test_tier_table():
    t = THRESHOLDS.benchmark_tiers
    assert dict(t["L0"]) == dict(THRESHOLDS.benchmark_ratio_limits) == {"small_value": 2.0, "rmse": 2.0,
                                                                        "max_rel": 10.0, "mean_rel": 2.0}
    assert (t["L1"]["max_rel"], t["L1"]["mean_rel"], t["L1"]["rmse"]) == (5.0, 1.5, 1.5)
    assert (t["L2"]["max_rel"], t["L2"]["mean_rel"], t["L2"]["rmse"]) == (2.0, 1.2, 1.2)


def _metrics(max_rel=0.01, mean_rel=0.01, rmse=0.01):
    return OutputMetrics(small_value_error_ratio=0.0, rmse=rmse, max_rel_err=max_rel, mean_rel_err=mean_rel,
                         error_balance=0.0)


@pytest.mark.parametrize("field, ratio, verdicts", [
    ("max_rel", 4.0, {"L0": "pass", "L1": "pass", "L2": "error"}),       # limits 10 / 5 / 2
    ("max_rel", 6.0, {"L0": "pass", "L1": "error", "L2": "error"}),
    ("mean_rel", 1.3, {"L0": "pass", "L1": "pass", "L2": "error"}),      # limits 2 / 1.5 / 1.2
    ("mean_rel", 1.6, {"L0": "pass", "L1": "error", "L2": "error"}),
    ("rmse", 1.3, {"L0": "pass", "L1": "pass", "L2": "error"}),
    ("rmse", 2.5, {"L0": "error", "L1": "error", "L2": "error"}),
])
def test_tiers_change_the_verdict(field, ratio, verdicts):
    same = _metrics()
    device = _metrics(**{field: 0.01 * ratio})
    for tier, expected in verdicts.items():
        res = STANDARD_REGISTRY["benchmark"].judge(StandardInput(F16, device, same, tier=tier))
        assert res.status == expected, (tier, res.messages)
    assert STANDARD_REGISTRY["benchmark"].judge(StandardInput(F16, device, same)).status == verdicts["L0"]


def test_tier_through_configure():
    # float32, one element of 1000 with relative error 2^-13 on the same-dtype run and 2^-11 on the device: max
    # relative error ratio 4 (floor 2^-14 below 2^-13); mean and RMSE ratios far below 1 (floored)
    bench = torch.ones(1000, dtype=torch.float64)
    same = bench.float()
    same[3] = 1 + 2.0 ** -13
    device = bench.float()
    device[3] = 1 + 2.0 ** -11
    for tier, expected in (("L0", "pass"), ("L1", "pass"), ("L2", "error")):
        configure({"Functional.gelu": ApiJudging(tier=tier)})
        r = judge("gelu", bench, device, same=same, category="Functional")
        assert r.status == expected, (tier, r.message)
        assert abs(r.cells["相对误差最大值比值"] - 4.0) < 1e-6


def test_metric_parameter_override_recomputes():
    # float16 mul, one element 1 ULP off at 1: relative error 2^-10 = rtol: in; 2 ULP: out; rtol 2^-8: in again
    bench = torch.ones(100, dtype=torch.float32)
    device = bench.half()
    device[0] = 1 + 2.0 ** -9
    assert judge("mul", bench, device).status == "error"
    configure({"Tensor.mul": ApiJudging(thresholds={"float16": {"rtol": 2.0 ** -8}})})
    assert judge("mul", bench, device, category="Tensor").status == "pass"
    assert judge("mul", bench, device, category="Torch").status == "error"


# ---- configure ----------------------------------------------------------------------------------------------------

def test_known_standards_and_names():
    assert known_standards() == ["absolute", "benchmark", "binary", "mixed_tolerance", "quantisation",
                                 "thousandth", "ulp"]
    assert threshold_names("mixed_tolerance") == ["atol", "rtol", "floor", "pass_rate", "max_ulp"]
    assert threshold_names("absolute") == ["small_value", "small_atol", "rtol"]
    assert threshold_names("quantisation") == ["max_diff"]
    assert threshold_names("binary") == []
    with pytest.raises(ValueError, match="unknown precision standard"):
        threshold_names("nope")


def test_configure_validation_one_line_per_problem():
    configure({"Functional.gelu": ApiJudging(tier="L1")})
    bad = {
        "gelu": ApiJudging(),
        "Functional.silu": ApiJudging(standard="nope"),
        "Functional.relu": ApiJudging(tier="L3"),
        "Functional.mish": ApiJudging(standard="ulp", tier="L1"),
        "Functional.elu": ApiJudging(standard="absolute", thresholds={"float17": {"rtol": 1.0},
                                                                      "float16": {"atol": 1.0, "rtol": -1.0}}),
        "Functional.selu": ApiJudging(standard="mixed_tolerance", thresholds={"bfloat16": {"pass_rate": 2.0}}),
        "Functional.celu": ApiJudging(thresholds={"float16": {"atol": 1.0}, "float8_e4m3fn": {"atol": 1.0}}),
        "Functional.glu": ApiJudging(standard="mixed_tolerance", thresholds={"int8": {"atol": 1.0}}),
        "Functional.hardtanh": "mixed_tolerance",
    }
    with pytest.raises(ValueError) as exc:
        configure(bad)
    lines = str(exc.value).splitlines()
    expected = [
        "'gelu': the key must be 'Category.api'",
        "'Functional.silu': unknown standard 'nope'",
        "'Functional.relu': unknown tier 'L3'",
        "'Functional.mish': tier 'L1' applies to the benchmark standard only, not 'ulp'",
        "'Functional.elu': unknown dtype 'float17'",
        "'Functional.elu': unknown threshold 'atol' for float16 with the absolute standard",
        "'Functional.elu': threshold 'rtol' for float16 must be a finite number >= 0, got -1.0",
        "'Functional.selu': threshold 'pass_rate' for bfloat16 must be in [0, 1], got 2.0",
        # celu's built-in standard is benchmark for float16 (no atol), mixed tolerance for float8 (atol: fine)
        "'Functional.celu': unknown threshold 'atol' for float16 with the benchmark standard",
        "'Functional.glu': unknown dtype 'int8'",
        "'Functional.hardtanh': expected an ApiJudging, got str",
    ]
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected):
        assert line.startswith(start), (line, start)
    # nothing changed
    assert dict(configured()) == {"Functional.gelu": ApiJudging(tier="L1")}


def test_configure_replaces():
    configure({"Functional.gelu": ApiJudging(standard="ulp")})
    configure({"Functional.silu": ApiJudging(standard="ulp")})
    assert list(configured()) == ["Functional.silu"]
    assert select_standard("gelu", F16) == "benchmark"


# ---- the report header ----------------------------------------------------------------------------------------------

def test_precision_details_header_keeps_msprobe_first(tmp_path):
    from gpu_server.reports import load
    from gpu_server.reports.rank_reports import RankReports, precision_detail_row

    rep = RankReports(str(tmp_path), "20260101000000", 0)
    bench, device = ones_with(100, F16)
    verdict = mixed(bench, device)
    rep.write([precision_detail_row("Functional.gelu.0.forward.output.0", verdict.cells, verdict.status,
                                    verdict.algorithm, verdict.message, 3)])
    rep.close()
    path = [p for p in rep.paths if "api_precision_compare_details" in os.path.basename(p)][0]
    with open(path, encoding="utf-8-sig") as fh:
        header, row = list(csv.reader(fh))
    assert header[:len(PRECISION_DETAILS_HEADER)] == PRECISION_DETAILS_HEADER
    n = len(PRECISION_DETAILS_HEADER)
    assert header[n:n + len(EXTRA_COLUMNS)] == EXTRA_COLUMNS
    assert header[n + len(EXTRA_COLUMNS):] == PRECISION_EXTRA_COLUMNS
    assert len(row) == len(header)
    cells = dict(zip(header, row))
    assert (cells["比对结果"], cells["Step"], cells[STATUS]) == ("pass", "3", "pass")
    frame = load(str(tmp_path), "precision_details")
    assert frame.loc[0, STATUS] == "pass" and frame.loc[0, "step"] == 3
