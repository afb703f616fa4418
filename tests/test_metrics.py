"""Per-output metrics (docs/standards.md). Every expected value is worked out by hand in the comments."""
import dataclasses
import math

import pytest
import torch

from gpu_server.columns import METRIC_COLUMNS
from gpu_server.judging.metrics import OutputMetrics, analyse, output_metrics, scalar_error_rate

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
INF, NAN = math.inf, math.nan


def t(values, dtype):
    return torch.tensor(values, dtype=dtype)


def test_fields_are_the_metric_columns_in_order():
    # `counts` (the element counts behind the shares, for the verdict's confidence bounds) is not a column
    assert [f.name for f in dataclasses.fields(OutputMetrics)] == [name for name, _ in METRIC_COLUMNS] + ["counts"]


def test_float32_every_metric_by_hand():
    # bench (float64) and device (float32); eps = machine eps of the float64 bench = 2^-52.
    bench = t([1.0, -2.0, 0.5, 2.0 ** -21, 0.0], F64)
    device = t([1.0 + 2.0 ** -23, -2.0, 0.5 - 2.0 ** -24, 0.0, 2.0 ** -31], F32)
    m = output_metrics(bench, device)
    # abs_err = [2^-23, 0, 2^-24, 2^-21, 2^-31]
    assert m.max_abs_err == 2.0 ** -21
    # rel_err = abs_err / (|bench| + 2^-52) ~= [2^-23, 0, 2^-23, 1, 2^21]: elements 0..2 are below every bound.
    assert m.hundredth == m.thousandth == m.ten_thousandth == 3 / 5
    # every element but index 1 differs
    assert m.binary_error_rate == 4 / 5
    # device > bench at 0 and 4, device < bench at 2 and 3: |2 - 2| / 5
    assert m.error_balance == 0.0
    # small = |bench| <= 2^-20: indices 3 and 4; abs_err 2^-21 > 2^-30 (bad), 2^-31 <= 2^-30 (good)
    assert m.small_value_error_ratio == m.abs_err_rate == 1 / 2
    # normal: indices 0..2; RMSE = sqrt((2^-46 + 0 + 2^-48) / 3)
    assert m.rmse == pytest.approx(math.sqrt((2.0 ** -46 + 2.0 ** -48) / 3), rel=1e-15)
    # max rel = 2^-23 / (1 + 2^-52); mean = (2^-23/(1+2^-52) + 0 + 2^-24/(0.5+2^-52)) / 3
    assert m.max_rel_err == pytest.approx(2.0 ** -23, rel=1e-15)
    assert m.mean_rel_err == pytest.approx(2 * 2.0 ** -23 / 3, rel=1e-15)
    # no normal rel_err above rtol 2^-20, no inf/nan element
    assert m.rel_err_rate == 0.0 and m.inf_nan_error_rate == 0.0
    # ULP (p 23, min_eb -126): eb = [0, 1, -1, -21, -126 (bench 0)]
    # ulp = [2^-23*2^23, 0, 2^-24*2^24, 2^-21*2^44, 2^-31*2^149] = [1, 0, 1, 2^23, 2^118]
    assert m.ulp_max == 2.0 ** 118
    assert m.ulp_mean == pytest.approx((2 + 2.0 ** 23 + 2.0 ** 118) / 5, rel=1e-15)
    assert m.ulp_over_threshold == 2 / 5  # 2^23 and 2^118 are above 32
    # cosine of ([1,-2,.5,~0,0]/2) and ([1,-2,.5,0,~0]/2): nearly parallel
    assert 0.999999 < m.cosine <= 1.0


def test_ulp_of_zero_bench_uses_min_exponent():
    # our fix, docs/standards.md (msprobe used eb = 0 for bench == 0). float16: p 10, min_eb -14, spacing at 0 = 2^-24.
    m = output_metrics(t([0.0, 0.0], F32), t([2.0 ** -24, 2.0 ** -13], F16))
    # ulp = [2^-24 * 2^24, 2^-13 * 2^24] = [1, 2048]; msprobe would give [2^-14, 2^-3]
    assert m.ulp_max == 2048.0
    assert m.ulp_mean == (1 + 2048) / 2
    assert m.ulp_over_threshold == 1 / 2  # 1 is not above the float16 threshold 1, 2048 is


def test_float16_subnormals():
    # float16 subnormal spacing 2^-24; bench 2^-20 = 16 spacings, below min_eb so eb = -14.
    bench = t([2.0 ** -20, 2.0 ** -20, 2.0 ** -20], F32)
    device = t([2.0 ** -20 + 2.0 ** -24, 2.0 ** -20 + 2.0 ** -23, 0.0], F16)  # +1 ulp, +2 ulp, flushed to zero
    m = output_metrics(bench, device)
    # ulp = [1, 2, 16]
    assert m.ulp_max == 16.0
    assert m.ulp_mean == pytest.approx(19 / 3)
    assert m.ulp_over_threshold == 2 / 3
    # all three are small (2^-20 <= 2^-10); abs_err [2^-24, 2^-23, 2^-20] vs small_atol 2^-16: none above
    assert m.small_value_error_ratio == 0.0 and m.abs_err_rate == 0.0
    # no normal elements: RMSE and rel errors 0
    assert m.rmse == 0.0 and m.max_rel_err == 0.0 and m.mean_rel_err == 0.0 and m.rel_err_rate == 0.0
    # eps = float32 eps 2^-23 (bench dtype): rel = [2^-24/(2^-20+2^-23), 2^-23/(2^-20+2^-23), 2^-20/(2^-20+2^-23)]
    #     = [1/18, 1/9, 8/9]: none below 0.01
    assert m.hundredth == 0.0


def test_float16_eps_is_the_float32_bench_eps():
    # bench 0 and device 2^-24: rel = 2^-24 / (0 + 2^-23) = 0.5 (with float16's own eps 2^-10 it would be 2^-14)
    m = output_metrics(t([0.0, 1.0], F32), t([2.0 ** -24, 1.0], F16))
    assert m.hundredth == 1 / 2


def test_bfloat16_parameters():
    # eps 2^-8 (bfloat16), rtol 2^-8, small_value 2^-10, small_atol 2^-16 (our fix, docs/standards.md: msprobe 1e-16)
    bench = t([2.0 ** -12, 2.0 ** -12, 1.0, 1.0], F32)
    device = t([2.0 ** -12 + 2.0 ** -17, 2.0 ** -12 + 2.0 ** -15, 1.0 + 2.0 ** -7, 1.0], BF16)
    m = output_metrics(bench, device)
    # small: indices 0, 1; abs_err 2^-17 <= 2^-16 passes, 2^-15 > 2^-16 fails (with 1e-16 both would fail)
    assert m.abs_err_rate == 1 / 2 and m.small_value_error_ratio == 1 / 2
    # normal: indices 2, 3; rel = 2^-7 / (1 + 2^-8) = 2/257 > 2^-8 = 1/256
    assert m.rel_err_rate == 1 / 2
    assert m.max_rel_err == pytest.approx(2 / 257, rel=1e-15)
    assert m.mean_rel_err == pytest.approx(1 / 257, rel=1e-15)
    assert m.rmse == pytest.approx(2.0 ** -7 / math.sqrt(2), rel=1e-15)
    # ULP (p 7, min_eb -126): index 0: eb -12, 2^-17 * 2^19 = 4; index 1: 2^-15 * 2^19 = 16; index 2: 2^-7 * 2^7 = 1
    assert m.ulp_max == 16.0
    assert m.ulp_mean == (4 + 16 + 1 + 0) / 4
    assert m.ulp_over_threshold == 2 / 4
    # rel for the double-x ratios uses eps 2^-8 too: index 0: 2^-17 / (2^-12 + 2^-8) = 1/544 = 0.0018 (< 0.01)
    # index 1: 2^-15 / (2^-12 + 2^-8) = 1/136 = 0.0074 (< 0.01); index 2: 2/257 = 0.0078 (< 0.01); index 3: 0
    assert m.hundredth == 1.0
    assert m.thousandth == 1 / 4


def test_inf_nan_rules_float16():
    bench = t([70000.0, INF, NAN, 1.0, INF, -INF, 100.0, 1.0], F32)
    device = t([INF, 65504.0, NAN, NAN, INF, INF, INF, 1.0], F16)
    m = output_metrics(bench, device)
    # inf/nan elements: indices 0..6 (bench 70000 is inf in float16; index 7 is finite on both sides)
    #   0: saturated 65504 vs 65504 -> pass       1: finite against an infinite bench -> fail (our fix,
    # docs/standards.md)
    #   2: both NaN -> pass                       3: NaN on the device only -> fail
    #   4: same infinity -> pass                  5: opposite infinities -> fail
    #   6: saturated 65504 vs 100: 65404 / 100 > 2^-10 -> fail
    assert m.inf_nan_error_rate == 4 / 7
    # binary: equal at 2 (both NaN), 4 and 7 -> 5 of 8 differ
    assert m.binary_error_rate == 5 / 8
    # only index 7 is normal (and exact); nothing small
    assert m.rel_err_rate == 0.0 and m.abs_err_rate == 0.0 and m.rmse == 0.0
    # rel < 0.01 only at index 7 (inf - inf and NaN compare false)
    assert m.hundredth == 1 / 8
    # ULP: NaN for an infinite/NaN bench and for a NaN device -> mean and max NaN;
    # above 1: index 0 (inf) and 6 (inf) -> 2 of 8
    assert math.isnan(m.ulp_mean) and math.isnan(m.ulp_max)
    assert m.ulp_over_threshold == 2 / 8
    # max |value| is inf/NaN: the normalised cosine is NaN
    assert math.isnan(m.cosine)
    assert math.isnan(m.max_abs_err)  # NaN - NaN


def test_bench_finiteness_is_taken_in_the_device_dtype():
    # 70000 overflows float16: the element is an inf/nan element, not a normal one; the device saturated to 65504
    # and the saturated values agree -> inf/nan error rate 0, no normal element -> rel_err_rate 0.
    # (Taken in float32 it would be a normal element with rel (70000-65504)/70000 = 0.064 > 2^-10.)
    m = output_metrics(t([70000.0], F32), t([65504.0], F16))
    assert m.inf_nan_error_rate == 0.0
    assert m.rel_err_rate == 0.0


def test_infinite_bench_against_finite_device_fails_in_float32():
    # msprobe divided by |bench| = inf and passed any finite value; we fail it. 3.0 vs -inf also fails.
    m = output_metrics(t([INF, -INF, 1.0], F64), t([3.0e38, INF, 1.0], F32))
    assert m.inf_nan_error_rate == 1.0  # both inf/nan elements fail


def test_empty_tensors():
    m = output_metrics(torch.empty(0, 3, dtype=F32), torch.empty(0, 3, dtype=F16))
    assert m.cosine is None
    # ratios of an empty set: double-x 1, error rates and shares 0; max/mean/RMSE 0
    assert (m.hundredth, m.thousandth, m.ten_thousandth) == (1.0, 1.0, 1.0)
    assert (m.binary_error_rate, m.error_balance, m.small_value_error_ratio, m.inf_nan_error_rate,
            m.rel_err_rate, m.abs_err_rate, m.ulp_over_threshold) == (0.0,) * 7
    assert (m.max_abs_err, m.rmse, m.max_rel_err, m.mean_rel_err, m.ulp_max, m.ulp_mean) == (0.0,) * 6
    assert output_metrics(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)).binary_error_rate == 0


def test_one_element():
    # bench 2, device 2 + 2^-9 (float16 spacing at 2 is 2^-9): cosine blank, 1 ulp
    m = output_metrics(t([2.0], F32), t([2.0 + 2.0 ** -9], F16))
    assert m.cosine is None
    assert m.max_abs_err == 2.0 ** -9
    assert m.ulp_max == 1.0 and m.ulp_over_threshold == 0.0
    m0 = output_metrics(torch.tensor(3.0, dtype=F64), torch.tensor(3.0, dtype=F32))  # 0-dim
    assert m0.cosine is None and m0.binary_error_rate == 0.0


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
                                   torch.uint32, torch.uint64, torch.bool])
def test_integer_and_bool_outputs_only_binary(dtype):
    bench = t([1, 0, 1, 1], dtype)
    device = t([1, 0, 0, 1], dtype)
    m = output_metrics(bench, device)
    assert m.binary_error_rate == 1 / 4  # index 2 differs
    assert all(getattr(m, f.name) is None for f in dataclasses.fields(m) if f.name != "binary_error_rate")
    assert output_metrics(bench, bench.clone()).binary_error_rate == 0.0


def test_integer_dtypes_of_different_width_compare_by_value():
    assert output_metrics(t([5, -3], torch.int64), t([5, -3], torch.int32)).binary_error_rate == 0.0
    assert output_metrics(t([5, 2 ** 63 - 1], torch.uint64), t([5, 7], torch.uint64)).binary_error_rate == 0.5


def test_cosine_cases():
    # (3,4)/4 = (.75, 1), (4,3)/4 = (1, .75): dot 1.5, norms sqrt(1.5625) = 1.25 -> 1.5 / 1.5625 = 0.96
    assert analyse(t([3.0, 4.0], F64), t([4.0, 3.0], F32)).metrics.cosine == pytest.approx(0.96, abs=1e-15)
    # orthogonal -> 0, anti-parallel -> -1, scaled copy -> 1
    assert analyse(t([1.0, 0.0], F64), t([0.0, 1.0], F32)).metrics.cosine == 0.0
    assert analyse(t([1.0, 2.0], F64), t([-1.0, -2.0], F32)).metrics.cosine == pytest.approx(-1.0)
    assert analyse(t([1.0, 2.0], F64), t([2.0, 4.0], F32)).metrics.cosine == pytest.approx(1.0)
    both_zero = analyse(torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F32)).cosine
    assert (both_zero.value, both_zero.passed) == (None, True)
    device_zero = analyse(t([1.0, 2.0], F64), torch.zeros(2, dtype=F32)).cosine
    assert (device_zero.value, device_zero.passed) == (None, False) and "device" in device_zero.note
    bench_zero = analyse(torch.zeros(2, dtype=F64), t([1.0, 2.0], F32)).cosine
    assert (bench_zero.value, bench_zero.passed) == (None, False) and "bench" in bench_zero.note
    one = analyse(t([5.0], F64), t([-5.0], F32)).cosine
    assert (one.value, one.passed) == (None, True)


def test_error_balance_counts_signs():
    # device above bench at 3 elements, below at 1, equal at 1: |3 - 1| / 5
    m = output_metrics(t([1.0, 2.0, 3.0, 4.0, 5.0], F64), t([1.5, 2.5, 3.5, 3.5, 5.0], F32))
    assert m.error_balance == 2 / 5


def test_absolute_threshold_rates_float16():
    # rtol 2^-10, small_value 2^-10, small_atol 2^-16; eps 2^-23 (float32 bench)
    bench = t([1.0, 1.0, 2.0 ** -11, 2.0 ** -11], F32)
    device = t([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -9, 2.0 ** -11 + 2.0 ** -16, 2.0 ** -11 + 2.0 ** -15], F16)
    m = output_metrics(bench, device)
    # normal: rel = 2^-10/(1+2^-23) <= 2^-10 passes; 2^-9/(1+2^-23) > 2^-10 fails
    assert m.rel_err_rate == 1 / 2
    # small: abs_err 2^-16 is not above 2^-16; 2^-15 is
    assert m.abs_err_rate == 1 / 2


def test_float64_device_uses_float64_parameters():
    # p 52, min_eb -1022; bench 1 vs 1 + 2^-52 -> 1 ulp; bench 0 vs 2^-1074 -> 2^-1074 * 2^(52+1022) = 1 (no overflow)
    m = output_metrics(t([1.0, 0.0], F64), t([1.0 + 2.0 ** -52, 2.0 ** -1074], F64))
    assert m.ulp_max == 1.0 and m.ulp_mean == 1.0 and m.ulp_over_threshold == 0.0
    # eps 2^-52: rel = 2^-52 / (1 + 2^-52) and 2^-1074 / 2^-52 = 2^-1022 -> both below 1e-4
    assert m.ten_thousandth == 1.0
    # small (|bench| <= 2^-20): index 1, abs_err 2^-1074 <= 2^-30
    assert m.abs_err_rate == 0.0


def test_complex_outputs_compare_real_and_imaginary_parts():
    bench = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)
    device = torch.tensor([1 + 2j, 3 + 0j], dtype=torch.complex64)
    m = output_metrics(bench, device)
    # parts [1, 2, 3, -1] vs [1, 2, 3, 0]: one of four differs by 1
    assert m.binary_error_rate == 1 / 4
    assert m.max_abs_err == 1.0


def test_chunked_equals_hand_values():
    # 10 elements in chunks of 3: bench 1.0 everywhere, device 1 + 2^-23 at indices 2 and 9 (1 ulp each)
    bench = torch.ones(10, dtype=F64)
    device = torch.ones(10, dtype=F32)
    device[2] = device[9] = 1.0 + 2.0 ** -23
    m = analyse(bench, device, chunk_elements=3).metrics
    assert m.binary_error_rate == 2 / 10
    assert m.ulp_max == 1.0 and m.ulp_mean == 2 / 10
    assert m.error_balance == 2 / 10
    assert m.rmse == pytest.approx(math.sqrt(2 * 2.0 ** -46 / 10), rel=1e-15)
    assert m.max_abs_err == 2.0 ** -23
    # cosine of (1,...,1) and (1,..,1+2^-23,..) normalised by 1+2^-23: 1 - O(2^-46)
    assert m.cosine == pytest.approx(1.0, abs=1e-12)
    # a NaN in the last chunk still reaches the max
    device[9] = NAN
    assert math.isnan(analyse(bench, device, chunk_elements=3).metrics.max_abs_err)


def test_non_contiguous_inputs():
    bench = t([[1.0, 2.0], [3.0, 4.0]], F64).t()
    device = t([[1.0, 2.0], [3.0, 5.0]], F32).t()
    assert output_metrics(bench, device).binary_error_rate == 1 / 4


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        output_metrics(torch.zeros(2), torch.zeros(3))


def test_scalar_error_rate():
    assert scalar_error_rate(3, 3) == 0.0
    assert scalar_error_rate(3, 4) == 1.0
    assert scalar_error_rate(NAN, NAN) == 0.0
    assert scalar_error_rate(True, 1) == 1.0  # bool against int: different types
