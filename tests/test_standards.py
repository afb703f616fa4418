"""Precision standards of docs/standards.md: selection by name and dtype, each standard's pass and fail side, the
deliberate
deviations from msprobe. Expected values are worked out in the comments."""
import math

import pytest
import torch

from gpu_server.columns import PRECISION_DETAILS_HEADER, PRECISION_EXTRA_COLUMNS
from gpu_server.judging.metrics import OutputMetrics
from gpu_server.judging.standards import STANDARD_REGISTRY, register_standard
from gpu_server.judging.standards.judging import judge
from gpu_server.judging.standards.registry import StandardInput
from gpu_server.judging.standards.selection import canonical_name, select_standard
from gpu_server.judging.standards.thresholds import THRESHOLDS

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
CELL_TITLES = set(PRECISION_DETAILS_HEADER + PRECISION_EXTRA_COLUMNS) - {"API Name", "比对结果", "比对算法", "Message"}


def t(values, dtype):
    return torch.tensor(values, dtype=dtype)


def filled(n, value, dtype, changes=()):
    x = torch.full((n,), value, dtype=dtype)
    for i, v in changes:
        x[i] = v
    return x


def check(api, bench, device, same=None):
    r = judge(api, bench, device, same)
    assert set(r.cells) <= CELL_TITLES
    return r


# ---- selection ---------------------------------------------------------------------------------------------------

# docs/standards.md's lists, verbatim.
LISTED_ABSOLUTE = """mul, mul_, __mul__, __imul__, __rmul__, add, add_, __add__, __iadd__, __radd__, div, div_, __div__,
__idiv__, divide, divide_, leaky_relu, leaky_relu_, prelu, reciprocal, reciprocal_, rsqrt, rsqrt_, square, square_,
sub, sub_, rsub, __isub__, __sub__, __truediv__, __rtruediv__, __rsub__"""
LISTED_BINARY = """abs, abs_, absolute, absolute_, argmin, bitwise_and, bitwise_and_, broadcast_to, ceil, ceil_, equal,
fill_, flatten, floor, floor_, gather, greater, greater_, greater_equal, greater_equal_, histc, isfinite, isnan, less,
less_, less_equal, less_equal_, logical_and, logical_and_, logical_not, logical_not_, logical_or, logical_or_,
masked_fill, masked_fill_, max_pool3d, maximum, minimum, neg, neg_, nonzero, not_equal, not_equal_, one_hot, pad, relu,
reshape, round, round_, select, sign, sign_, sort, tile, topk, transpose, transpose_, tril, tril_, triu, triu_,
type_as"""
LISTED_ULP = """__matmul__, addbmm, addbmm_, addmm, addmm_, baddbmm, baddbmm_, bilinear, bmm, chain_matmul, hspmm,
linear,
matmul, mm, mv, smm, sspaddmm"""


def names(text):
    return [n.strip() for n in text.replace("\n", " ").split(",")]


@pytest.mark.parametrize("key, listed", [("absolute", LISTED_ABSOLUTE), ("binary", LISTED_BINARY), ("ulp", LISTED_ULP),
                                         ("thousandth", "conv1d, conv2d")])
def test_every_spec_listed_name_selects_its_standard(key, listed):
    for name in names(listed):
        for dtype in (F16, BF16, F32):
            assert select_standard(name, dtype) == key, name


@pytest.mark.parametrize("name, key", [
    # Python-3 and reflected / in-place operator spellings of the listed operations
    ("__truediv__", "absolute"), ("__rtruediv__", "absolute"), ("__itruediv__", "absolute"), ("__rdiv__", "absolute"),
    ("__rsub__", "absolute"), ("__rmul__", "absolute"), ("__iadd__", "absolute"), ("divide_", "absolute"),
    # aten overloads
    ("mul.Tensor", "absolute"), ("add.Tensor", "absolute"), ("mm.default", "ulp"),
    # in-place / dunder spellings of binary-listed names
    ("relu_", "binary"), ("__abs__", "binary"), ("__neg__", "binary"), ("__round__", "binary"), ("__and__", "binary"),
    ("__iand__", "binary"), ("fill", "binary"),
    # matmul family
    ("__rmatmul__", "ulp"), ("__imatmul__", "ulp"), ("linear", "ulp"), ("matmul_", "ulp"),
    # everything else, npu_* fused ops included
    ("npu_rms_norm", "benchmark"), ("npu_fusion_attention", "benchmark"), ("npu_linear", "benchmark"),
    ("softmax", "benchmark"), ("conv3d", "benchmark"), ("__pow__", "benchmark"), ("__rshift__", "benchmark"),
    ("true_divide", "benchmark"), ("multiply", "benchmark"), ("sum", "benchmark"), ("", "benchmark"),
])
def test_spelling_families(name, key):
    assert select_standard(name, F32) == key


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
                                   torch.uint32, torch.uint64, torch.bool, None])
@pytest.mark.parametrize("name", ["linear", "add", "npu_rms_norm", "conv2d"])
def test_integer_bool_and_scalar_outputs_select_binary(name, dtype):
    assert select_standard(name, dtype) == "binary"


def test_canonical_name():
    assert canonical_name("__radd__") == "add"
    assert canonical_name("__itruediv__") == "div"
    assert canonical_name("__rshift__") == "rshift"  # r is part of the name, not the reflected prefix
    assert canonical_name("__round__") == "round"
    assert canonical_name("rsub") == "rsub"  # the torch function keeps its name
    assert canonical_name("add_") == "add"


def test_registry_holds_the_seven_standards():
    assert {k: s.algorithm for k, s in STANDARD_REGISTRY.items()} == {
        "benchmark": "标杆比对法", "ulp": "ULP误差比对法", "binary": "二进制一致法", "absolute": "绝对阈值法",
        "thousandth": "双千指标法", "mixed_tolerance": "混合容差比对法", "quantisation": "量化比对法"}
    with pytest.raises(ValueError):
        register_standard("binary", "x")(lambda inp: None)


def test_threshold_table_matches_spec():
    f16, bf16, f32 = (THRESHOLDS.per_dtype[d] for d in (F16, BF16, F32))
    assert (f16.small_value, bf16.small_value, f32.small_value) == (2 ** -10, 2 ** -10, 2 ** -20)
    assert (f16.rtol, bf16.rtol, f32.rtol) == (2 ** -10, 2 ** -8, 2 ** -20)
    assert (f16.small_atol, bf16.small_atol, f32.small_atol) == (2 ** -16, 2 ** -16, 2 ** -30)
    assert (f16.ratio_floor, bf16.ratio_floor, f32.ratio_floor) == (2 ** -11, 2 ** -8, 2 ** -14)
    assert [(r.ulp_precision, r.ulp_min_exponent, r.ulp_threshold) for r in (f16, bf16, f32)] == [
        (10, -14, 1), (7, -126, 1), (23, -126, 32)]
    assert dict(THRESHOLDS.benchmark_ratio_limits) == {"small_value": 2, "rmse": 2, "max_rel": 10, "mean_rel": 2}


# ---- absolute threshold ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("api", ["add", "add_", "__radd__", "__iadd__"])
def test_absolute_pass_with_bf16_small_atol(api):
    # bf16: index 0 normal and exact; index 1 small (2^-12 <= 2^-10) with abs err 2^-17 <= 2^-16 (our 2^-16;
    # msprobe's 1e-16 would fail it)
    bench = t([1.0, 2.0 ** -12], F32)
    device = t([1.0, 2.0 ** -12 + 2.0 ** -17], BF16)
    r = check(api, bench, device, t([1.0, 2.0 ** -12], BF16))
    assert (r.status, r.algorithm) == ("pass", "绝对阈值法")
    assert r.cells["绝对误差错误率"] == 0.0 and r.cells["绝对误差判定结果"] == "pass"
    assert r.cells["相对误差错误率"] == 0.0 and r.cells["inf/nan错误率"] == 0.0


def test_absolute_fail_on_relative_error():
    # bf16 1 + 2^-7 against 1: rel 2^-7 / (1 + 2^-8) = 2/257 > rtol 2^-8 -> 1 of 1 normal element
    r = check("__truediv__", t([1.0, 2.0 ** -12], F32), t([1.0 + 2.0 ** -7, 2.0 ** -12], BF16),
              t([1.0, 2.0 ** -12], BF16))
    assert r.status == "error"
    assert r.cells["相对误差错误率"] == 1.0 and r.cells["相对误差判定结果"] == "error"
    assert r.cells["绝对误差判定结果"] == "pass"
    assert "相对误差错误率超过阈值 (1 > 0)" in r.message


def test_absolute_finite_against_infinite_bench_fails():
    # msprobe passed it (|bench| = inf in the denominator); one of one inf/nan element fails
    r = check("mul", t([math.inf, 1.0], F64), t([3.0e38, 1.0], F32), t([math.inf, 1.0], F32))
    assert r.status == "error" and r.cells["inf/nan错误率"] == 1.0


def test_absolute_saturated_overflow_passes():
    # bench 70000 is inf in float16; device and same +inf: saturated to 65504 both -> pass
    r = check("mul", t([70000.0, 1.0], F32), t([math.inf, 1.0], F16), None)
    assert r.status == "pass" and r.cells["inf/nan错误率"] == 0.0


# ---- binary ------------------------------------------------------------------------------------------------------

def test_binary_float_pass_and_fail():
    bench = t([1.5, -2.0, math.nan], F32)
    assert check("abs", bench, t([1.5, -2.0, math.nan], F16)).status == "pass"  # both NaN is consistent
    r = check("floor", bench, t([1.5, -1.0, math.nan], F16))
    assert (r.status, r.algorithm) == ("error", "二进制一致法")
    assert r.cells["二进制一致错误率"] == pytest.approx(1 / 3) and r.cells["二进制一致错误率判定结果"] == "error"


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
                                   torch.uint32, torch.uint64, torch.bool])
def test_integer_outputs_are_binary_whatever_the_name(dtype):
    bench = t([1, 0, 1, 1], dtype)
    r = check("linear", bench, t([1, 0, 0, 1], dtype))
    assert (r.status, r.algorithm, r.cells["二进制一致错误率"]) == ("error", "二进制一致法", 0.25)
    assert check("npu_rms_norm", bench, bench.clone()).status == "pass"


def test_python_scalars_are_binary():
    assert (judge("add", 3, 3, 3).status, judge("add", 3, 3, 3).algorithm) == ("pass", "二进制一致法")
    assert judge("add", 3, 4, 3).status == "error"


# ---- double-thousandth -------------------------------------------------------------------------------------------

def test_thousandth_boundary_passes_with_ge():
    # one of 1000 at 10.02 (rel 0.002): share 0.999 >= 0.999 -> pass (run_ut's > 0.999 would not)
    r = check("conv2d", filled(1000, 10.0, F64), filled(1000, 10.0, F32, [(0, 10.02)]), filled(1000, 10.0, F32))
    assert (r.status, r.algorithm) == ("pass", "双千指标法") and r.cells["双千指标"] == 0.999
    # two of 1000: 0.998 < 0.999
    r = check("conv1d", filled(1000, 10.0, F64), filled(1000, 10.0, F32, [(0, 10.02), (1, 10.02)]),
              filled(1000, 10.0, F32))
    assert r.status == "error" and r.cells["双千指标判定结果"] == "error" and "0.998 < 0.999" in r.message


# ---- ULP ---------------------------------------------------------------------------------------------------------

def ones_with(n, dtype, value, idx):
    return filled(n, 1.0, dtype, [(i, value) for i in idx])


def test_ulp_ratio_equal_to_one_passes():
    # float32, bench 1: 1 + 2^-16 is 2^-16 * 2^23 = 128 ulp (> 32). Device: 6 of 10 -> mean 76.8 >= 64, share 0.6 >=
    # 0.05. Same-dtype: 6 of 10 elsewhere at 1 + 2^-15 -> share 0.6. ratio = 0.6 / max(0.6, 2^-14) = 1 -> pass
    # (our fix, docs/standards.md; msprobe needed ratio < 1).
    bench = torch.ones(10, dtype=F64)
    device = ones_with(10, F32, 1.0 + 2.0 ** -16, range(6))
    same = ones_with(10, F32, 1.0 + 2.0 ** -15, range(4, 10))
    r = check("matmul", bench, device, same)
    assert (r.status, r.algorithm) == ("pass", "ULP误差比对法")
    assert r.cells["ULP误差平均值"] == pytest.approx(76.8)
    assert r.cells["ULP误差大于阈值占比"] == 0.6 and r.cells["ULP误差大于阈值占比比值"] == 1.0


def test_ulp_ratio_above_one_fails():
    # same-dtype share 300/1000 -> ratio 0.6 / 0.3 = 2 > 1; mean 76.8 >= 64; share 0.6 >= 0.05; on 1000 elements
    # the Wilson bounds (z = 3) still separate them: lower 0.55 > upper 0.35
    bench = torch.ones(1000, dtype=F64)
    r = check("linear", bench, ones_with(1000, F32, 1.0 + 2.0 ** -16, range(600)),
              ones_with(1000, F32, 1.0 + 2.0 ** -16, range(700, 1000)))
    assert r.status == "error" and r.cells["ULP误差判定结果"] == "error"
    assert r.cells["ULP误差大于阈值占比比值"] == pytest.approx(2.0)
    assert "ratio 2," in r.message and "against the spread (Wilson bounds) > 1" in r.message


def test_ulp_ratio_on_few_elements_uses_confidence_bounds():
    # msprobe: 6 of 10 against 3 of 10 is ratio 2 > 1, error. Ten elements cannot tell 0.6 from 0.3: the lower
    # Wilson bound of 6/10 (0.2) is below the upper bound of 3/10 (0.72) -> pass, msprobe's ratio cell kept
    bench = torch.ones(10, dtype=F64)
    r = check("linear", bench, ones_with(10, F32, 1.0 + 2.0 ** -16, range(6)),
              ones_with(10, F32, 1.0 + 2.0 ** -16, range(7, 10)))
    assert r.status == "pass" and r.cells["ULP误差大于阈值占比比值"] == pytest.approx(2.0)
    assert "Wilson" in r.message


def test_ulp_float32_passes_by_mean_or_by_share():
    bench = torch.ones(100, dtype=F64)
    exact = torch.ones(100, dtype=F32)
    # 60 of 100 at 1 + 2^-17 = 64 ulp each (> 32): share 0.6, but mean 38.4 < 64 -> pass
    assert check("mm", bench, ones_with(100, F32, 1.0 + 2.0 ** -17, range(60)), exact).status == "pass"
    # 4 of 100 at 1 + 2^-10 = 8192 ulp: mean 327.68 >= 64, but share 0.04 < 0.05 -> pass
    assert check("bmm", bench, ones_with(100, F32, 1.0 + 2.0 ** -10, range(4)), exact).status == "pass"
    # 6 of 100: mean 491.52, share 0.06, ratio 0.06 / 2^-14 -> error
    assert check("bmm", bench, ones_with(100, F32, 1.0 + 2.0 ** -10, range(6)), exact).status == "error"


def test_ulp_float16_share_limit():
    # float16: 2 ulp at 1 is 1 + 2^-9. 1 of 2000 -> share 0.0005 < 0.001 -> pass; 2 of 1000 -> 0.002, ratio
    # 0.002 / 2^-11 = 4.1 -> error in msprobe; 2 of 1000 is not evidence against a same-dtype run with 0 of 1000
    # (Wilson bounds, docs/standards.md) -> pass; 20 of 1000 is
    assert check("mm", torch.ones(2000), ones_with(2000, F16, 1.0 + 2.0 ** -9, [0]),
                 torch.ones(2000, dtype=F16)).status == "pass"
    assert check("mm", torch.ones(1000), ones_with(1000, F16, 1.0 + 2.0 ** -9, [0, 1]),
                 torch.ones(1000, dtype=F16)).status == "pass"
    assert check("mm", torch.ones(1000), ones_with(1000, F16, 1.0 + 2.0 ** -9, range(20)),
                 torch.ones(1000, dtype=F16)).status == "error"
    # 2 of 1000 far out (2^-5: 32 ULP > 4 x the threshold) -> error
    assert check("mm", torch.ones(1000), ones_with(1000, F16, 1.0 + 2.0 ** -5, [0, 1]),
                 torch.ones(1000, dtype=F16)).status == "error"


def test_ulp_zero_bench_uses_min_exponent():
    # float16 bench 0, device 2^-13: 2^-13 * 2^(10 + 14) = 2048 ulp each -> share 1, ratio 1 / 2^-11 -> error.
    # msprobe's eb = 0 gives 2^-13 * 2^10 = 0.125 ulp and a pass.
    r = check("matmul", torch.zeros(4), filled(4, 2.0 ** -13, F16), torch.zeros(4, dtype=F16))
    assert r.status == "error" and r.cells["ULP误差平均值"] == 2048.0


def test_ulp_nan_mean_must_match_the_same_dtype_run():
    bench = t([1.0, 1.0, 1.0, 1.0], F32)
    # device NaN where the bench is finite: mean NaN, same-dtype mean 0 -> error
    r = check("mm", bench, t([math.nan, 1.0, 1.0, 1.0], F16), t([1.0, 1.0, 1.0, 1.0], F16))
    assert r.status == "error" and "inf或nan不一致" in r.message
    # an infinite bench: mean NaN on both sides -> consistent; share 0 < 0.001 -> pass (same differs by 1 ulp, so not
    # bit-identical)
    bench = t([math.inf, 1.0, 1.0, 1.0], F32)
    r = check("mm", bench, t([math.inf, 1.0, 1.0, 1.0], F16), t([math.inf, 1.0, 1.0, 1.0 + 2.0 ** -10], F16))
    assert r.status == "pass" and math.isnan(r.cells["ULP误差平均值"])
    # without the same-dtype run the inf/NaN cannot be checked
    assert check("mm", bench, t([math.inf, 1.0, 1.0, 1.0], F16), None).status == "SKIP"


# ---- benchmark ---------------------------------------------------------------------------------------------------

def test_benchmark_bf16_pass_and_error():
    bench = torch.ones(4)
    same = torch.ones(4, dtype=BF16)  # all same-dtype metrics 0 -> denominators are the bf16 floor 2^-8
    # device 1 + 2^-7 at one of four: RMSE sqrt(2^-14 / 4) = 2^-8 -> ratio 1; max rel 2^-7/(1 + 2^-8) = 2/257 ->
    # ratio 512/257 = 1.99 <= 10; mean rel (2/257)/4 -> ratio 128/257 = 0.498 <= 2
    r = check("npu_rms_norm", bench, ones_with(4, BF16, 1.0 + 2.0 ** -7, [0]), same)
    assert (r.status, r.algorithm) == ("pass", "标杆比对法")
    assert r.cells["均方根误差比值"] == pytest.approx(1.0, rel=1e-12)
    assert r.cells["相对误差最大值比值"] == pytest.approx(512 / 257, rel=1e-12)
    assert r.cells["相对误差平均值比值"] == pytest.approx(128 / 257, rel=1e-12)
    assert r.cells["小值域错误比值"] == 0.0
    # error balance: device above at 1 of 4 -> 0.25 / 2^-8 = 64, reported but not judged
    assert r.cells["误差均衡性比值"] == pytest.approx(64.0) and "误差均衡性判定结果" not in r.cells
    # device 1 + 2^-5: RMSE 2^-6 -> ratio 4 > 2 (error); max rel 8/257 -> 2048/257 = 7.97 <= 10; mean rel 2/257 ->
    # 512/257 = 1.99 <= 2
    r = check("softmax", bench, ones_with(4, BF16, 1.0 + 2.0 ** -5, [0]), same)
    assert r.status == "error"
    assert r.cells["均方根误差比值"] == pytest.approx(4.0) and r.cells["均方根误差判定结果"] == "error"
    assert r.cells["相对误差最大值判定结果"] == "pass" and r.cells["相对误差平均值判定结果"] == "pass"
    assert "均方根误差比值超过阈值" in r.message and "相对误差最大值" not in r.message


def test_benchmark_uses_the_same_dtype_metric():
    # same-dtype 1 + 2^-6 (RMSE 2^-7), device 1 + 2^-5 (RMSE 2^-6): ratio 2 <= 2 -> pass (the limit itself passes);
    # max rel 8/257 vs 4/257 -> 2; mean rel 2/257 vs 1/257, which is below the floor 2^-8 = 1/256 -> 512/257
    bench = torch.ones(4)
    r = check("gelu", bench, ones_with(4, BF16, 1.0 + 2.0 ** -5, [0]), ones_with(4, BF16, 1.0 + 2.0 ** -6, [0]))
    assert r.status == "pass"
    assert r.cells["均方根误差比值"] == pytest.approx(2.0) and r.cells["相对误差最大值比值"] == pytest.approx(2.0)
    assert r.cells["相对误差平均值比值"] == pytest.approx(512 / 257)


@pytest.mark.parametrize("dtype, bump, floor", [(F16, 2.0 ** -10, 2.0 ** -11), (F32, 2.0 ** -13, 2.0 ** -14)])
def test_benchmark_ratio_floor_per_dtype(dtype, bump, floor):
    # one of four off by `bump`: RMSE bump / 2 = floor -> ratio 1 with the dtype's floor (the bf16 floor 2^-8 would
    # give a smaller ratio, float32's 2^-14 a larger one for float16)
    bench = torch.ones(4, dtype=F64 if dtype == F32 else F32)
    r = check("tanh", bench, ones_with(4, dtype, 1.0 + bump, [0]), torch.ones(4, dtype=dtype))
    assert r.cells["均方根误差比值"] == pytest.approx(bump / 2 / floor) == pytest.approx(1.0)
    assert r.status == "pass"


def test_benchmark_without_same_dtype_run_is_skip():
    r = check("tanh", torch.ones(4), torch.ones(4, dtype=F16), None)
    assert r.status == "SKIP" and "same-dtype" in r.message


def metrics(**kw):
    base = dict(small_value_error_ratio=0.0, rmse=0.0, max_rel_err=0.0, mean_rel_err=0.0, error_balance=0.0)
    return OutputMetrics(**{**base, **kw})


def test_benchmark_inf_nan_metric_rule():
    bench = STANDARD_REGISTRY["benchmark"].judge
    # NaN against NaN: consistent -> pass, ratio cell NaN
    r = bench(StandardInput(F16, metrics(rmse=math.nan), metrics(rmse=math.nan)))
    assert r.status == "pass" and math.isnan(r.cells["均方根误差比值"])
    # NaN against a finite same-dtype metric -> error
    r = bench(StandardInput(F16, metrics(rmse=math.nan), metrics(rmse=0.1)))
    assert r.status == "error" and "均方根误差inf或nan不一致" in r.messages[0]
    # inf against inf -> pass; inf against NaN -> error
    assert bench(StandardInput(F32, metrics(max_rel_err=math.inf), metrics(max_rel_err=math.inf))).status == "pass"
    assert bench(StandardInput(F32, metrics(max_rel_err=math.inf), metrics(max_rel_err=math.nan))).status == "error"
    # a finite device metric against a non-finite same-dtype metric is no worse: ratio 0
    r = bench(StandardInput(F32, metrics(rmse=0.5), metrics(rmse=math.inf)))
    assert r.status == "pass" and r.cells["均方根误差比值"] == 0.0


# ---- cross-cutting rules -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F64, torch.complex64, torch.complex128])
def test_float64_and_complex_are_skip(dtype):
    r = check("add", torch.ones(3, dtype=dtype), torch.ones(3, dtype=dtype), torch.ones(3, dtype=dtype))
    assert r.status == "SKIP" and "not supported by the precision standard" in r.message


def test_shape_mismatch_is_error():
    r = check("add", torch.ones(2, 3), torch.ones(3, 2, dtype=F16), torch.ones(3, 2, dtype=F16))
    assert r.status == "error" and "(2, 3)" in r.message and "(3, 2)" in r.message


def test_bit_identical_same_dtype_run_passes():
    # absolute threshold alone fails (1.5 vs bench 1.0), but the trusted host computes exactly the same in float16
    device = t([1.5, 2.0, math.nan], F16)
    r = check("add", t([1.0, 2.0, math.nan], F32), device, device.clone())
    assert r.status == "pass" and "bit-identical" in r.message
    assert r.cells["相对误差判定结果"] == "error"  # the standard's own finding stays visible
    # one bit off in the same-dtype run: the standard decides
    assert check("add", t([1.0, 2.0, math.nan], F32), device, t([1.5, 2.0 + 2.0 ** -9, math.nan], F16)).status == \
        "error"


def test_empty_outputs_pass():
    r = check("add", torch.empty(0), torch.empty(0, dtype=F16), torch.empty(0, dtype=F16))
    assert r.status == "pass"
    assert check("tanh", torch.empty(0, 2), torch.empty(0, 2, dtype=BF16), torch.empty(0, 2, dtype=BF16)).status == \
        "pass"


def test_none_bench_is_skip():
    assert judge("add", None, torch.ones(1), None).status == "SKIP"


def test_unusable_same_dtype_run_is_ignored():
    # a same-dtype output of another shape cannot serve as the reference: benchmark has nothing to divide by -> SKIP
    r = check("tanh", torch.ones(4), torch.ones(4, dtype=F16), torch.ones(5, dtype=F16))
    assert r.status == "SKIP" and "same-dtype run output ignored" in r.message and "(5,)" in r.message


def test_double_thousandth_judged_against_the_spread():
    """bfloat16 rounding alone puts about half of the elements outside 0.001: a device with as many elements outside
    as a correct same-dtype run passes; one with clearly more does not (docs/standards.md, the spread)."""
    torch.manual_seed(0)
    bench = torch.randn(4096) * 3
    rounded = bench.to(torch.bfloat16)
    assert check("conv2d", bench, rounded, rounded.clone()).status == "pass"          # bit-identical
    other = (bench * (1 + 2.0 ** -12)).to(torch.bfloat16)                            # another correct rounding
    r = check("conv2d", bench, other, rounded)
    assert r.status == "pass" and r.cells["双千指标"] < 0.999 and "Wilson" in r.message
    wrong = (bench * (1 + 2.0 ** -7)).to(torch.bfloat16)                             # 0.8 % off everywhere
    assert check("conv2d", bench, wrong, rounded).status == "error"


# ---- issue 24: the judge with spread runs, and the absolute threshold's exact limit ------------------------------

def _correct_runs(bench, dtype, n=3):
    """`n` correct same-dtype outputs: the bench rounded to `dtype`, and the bench nudged by a relative 2^-30 (far
    below any tolerance) before rounding, so that each is a correct run of its own."""
    return [(bench * (1 + i * 2.0 ** -30)).to(dtype) for i in range(n)]


@pytest.mark.parametrize("api, dtype, wrong", [
    ("mul", F32, lambda b: torch.where(torch.arange(b.numel()) % 10 == 0, b * 1.01, b)),   # absolute threshold
    ("matmul", F32, lambda b: b * (1 + 2.0 ** -12)),                                        # ULP
    ("conv2d", F32, lambda b: b * (1 + 2.0 ** -7)),                                         # double-thousandth
    ("tanh", BF16, lambda b: b * 1.05),                                                     # benchmark
])
def test_clearly_wrong_device_is_error_even_with_spread_runs(api, dtype, wrong):
    """With a same-dtype run and correct spread runs present (they make the ratio tests more lenient), a device
    output that is clearly wrong stays error: a judge that passes whenever spread runs exist fails this."""
    torch.manual_seed(0)
    bench = torch.randn(2048, dtype=F64) + 2.0
    same, *spread = _correct_runs(bench, dtype)
    device = wrong(bench).to(dtype)
    assert check(api, bench, device, same).status == "error"
    r = judge(api, bench, device, same, spread)
    assert r.status == "error", (api, r.message)
    # and the correct runs themselves pass, spread or not
    assert judge(api, bench, spread[0], same, spread).status == "pass"


@pytest.mark.parametrize("changed, n, status, rate", [
    (0, 100, "pass", 0.0),
    (1, 100, "error", 0.01),      # a 1 % relative error rate: any rate above 0 is an error
    (1, 1000, "error", 0.001),
    (5, 100, "error", 0.05),
])
def test_absolute_threshold_relative_error_rate_limit_is_zero(changed, n, status, rate):
    """docs/standards.md, absolute threshold: each of the three error rates must be 0. float32: rtol 2^-20; the
    changed elements are 9 ULP (9 * 2^-23 = 1.125 rtol) off a bench of 1, just above the tolerance."""
    assert THRESHOLDS.for_dtype(F32).rtol == 2.0 ** -20
    bench = torch.ones(n, dtype=F64)
    device = filled(n, 1.0, F32, [(i, 1.0 + 9 * 2.0 ** -23) for i in range(changed)])
    r = check("mul", bench, device, bench.to(F32))
    assert (r.status, r.cells["相对误差错误率"]) == (status, pytest.approx(rate)), r.message
    assert r.cells["相对误差判定结果"] == status


@pytest.mark.parametrize("ulps, status", [(7, "pass"), (8, "pass"), (9, "error")])
def test_absolute_threshold_relative_tolerance_just_below_and_above(ulps, status):
    # float32 bench 1, every element `ulps` * 2^-23 off: relative error ulps/8 * rtol; at or below rtol passes
    bench = torch.ones(200, dtype=F64)
    device = torch.full((200,), 1.0 + ulps * 2.0 ** -23, dtype=F32)
    r = check("add", bench, device, bench.to(F32))
    assert r.status == status and r.cells["相对误差错误率"] == (0.0 if status == "pass" else 1.0), r.message


@pytest.mark.parametrize("off, status, rate", [(2.0 ** -31, "pass", 0.0), (2.0 ** -29, "error", 0.01)])
def test_absolute_threshold_small_value_error_rate_limit_is_zero(off, status, rate):
    # float32: |bench| <= 2^-20 is small, judged by |error| <= small_atol 2^-30; one of 100 small elements off
    t32 = THRESHOLDS.for_dtype(F32)
    assert (t32.small_value, t32.small_atol) == (2.0 ** -20, 2.0 ** -30)
    bench = torch.full((100,), 2.0 ** -22, dtype=F64)
    device = filled(100, 2.0 ** -22, F32, [(0, 2.0 ** -22 + off)])
    r = check("sub", bench, device, bench.to(F32))
    assert (r.status, r.cells["绝对误差错误率"]) == (status, pytest.approx(rate)), r.message
