"""Two-way status of docs/standards.md and the API-level aggregation. Expected values are worked out in the comments."""
import math

import pytest
import torch

from gpu_server.judging.verdict import compare_output
from gpu_server.statuses import aggregate

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def filled(n, value, dtype, changes=()):
    x = torch.full((n,), value, dtype=dtype)
    for i, v in changes:
        x[i] = v
    return x


# ---- aggregation -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("statuses, expected", [
    ([], " "),
    (["SKIP", "SKIP"], "SKIP"),
    (["error", "Warning"], "error"),
    (["Warning", "error"], "error"),   # msprobe's run_ut: the last non-pass row wins -> Warning; any error wins here
    (["pass", "Warning", "pass"], "Warning"),
    (["pass", "SKIP"], "pass"),
    (["SKIP", "error"], "error"),
    (["pass"], "pass"),
])
def test_aggregate(statuses, expected):
    assert aggregate(statuses) == expected


# ---- structure ---------------------------------------------------------------------------------------------------

def test_none_bench_is_skip():
    r = compare_output(None, torch.ones(2))
    assert (r.status, r.metrics) == ("SKIP", None) and "None" in r.message


def test_shape_mismatch_is_error_naming_both_shapes():
    r = compare_output(torch.zeros(2, 3, dtype=F64), torch.zeros(3, 2))
    assert r.status == "error"
    assert "(2, 3)" in r.message and "(3, 2)" in r.message


@pytest.mark.parametrize("device_dtype", [torch.int64, torch.bool, torch.int32])
def test_dtype_kind_mismatch_is_error(device_dtype):
    r = compare_output(torch.zeros(3, dtype=F32), torch.zeros(3, dtype=device_dtype))
    assert r.status == "error" and "float32" in r.message and str(device_dtype).replace("torch.", "") in r.message


def test_tensor_against_scalar_is_error():
    assert compare_output(torch.ones(1), 1.0).status == "error"


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
                                   torch.uint32, torch.uint64, torch.bool])
def test_every_integer_dtype_compares(dtype):
    # msprobe rejected int8/int16/uint16/uint32/uint64 as "cannot compare"
    bench = torch.tensor([0, 1, 1, 0], dtype=dtype)
    same = compare_output(bench, bench.clone())
    assert (same.status, same.metrics.binary_error_rate) == ("pass", 0.0)
    diff = compare_output(bench, torch.tensor([0, 1, 0, 0], dtype=dtype))
    # one element of four differs
    assert (diff.status, diff.metrics.binary_error_rate) == ("error", 0.25)
    assert "1 of 4" in diff.message


@pytest.mark.parametrize("bench, device, status", [
    (3, 3, "pass"), (3, 4, "error"), (1.5, 1.5, "pass"), (1.5, 1.25, "error"), (float("nan"), float("nan"), "pass"),
    (True, True, "pass"), (True, False, "error"), (True, 1, "error"), ("a", "a", "pass"),
])
def test_python_scalars(bench, device, status):
    r = compare_output(bench, device)
    assert r.status == status
    assert r.metrics.binary_error_rate == (0.0 if status == "pass" else 1.0)


# ---- float path --------------------------------------------------------------------------------------------------

def test_cosine_gate():
    # (1,0) against (0,1): cosine 0 <= 0.99
    r = compare_output(torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([0.0, 1.0]))
    assert r.status == "error" and "cosine 0 <= 0.99" in r.message


def test_one_side_all_zero_is_error_both_zero_pass():
    r = compare_output(torch.tensor([1.0, 2.0], dtype=F64), torch.zeros(2))
    assert r.status == "error" and "all zero" in r.message and r.metrics.cosine is None
    assert compare_output(torch.zeros(4, dtype=F64), torch.zeros(4)).status == "pass"


def test_inf_in_a_multi_element_output_is_judged_on_the_finite_part_when_both_sides_agree():
    # normalising by an infinite max gives a NaN cosine (msprobe: error); the infinities agree, so the finite part
    # decides (docs/standards.md, "Non-finite values")
    r = compare_output(torch.tensor([float("inf"), 1.0], dtype=F64), torch.tensor([float("inf"), 1.0]))
    assert r.status == "pass" and "in both" in r.message and math.isnan(r.metrics.cosine)
    wrong = compare_output(torch.tensor([float("inf"), 1.0], dtype=F64), torch.tensor([float("inf"), 2.0]))
    assert wrong.status == "error" and "finite elements" in wrong.message


def test_inf_where_the_bench_is_finite_is_error():
    r = compare_output(torch.tensor([3.0, 1.0], dtype=F64), torch.tensor([float("inf"), 1.0]))
    assert r.status == "error" and "NaN" in r.message


def test_max_abs_error_below_0_001_passes():
    # 10 vs 10.0005 (float32): abs err ~0.0005 < 0.001, although rel err 5e-5 would not matter anyway
    r = compare_output(filled(10, 10.0, F64), filled(10, 10.0, F32, [(0, 10.0005)]))
    assert r.status == "pass" and "max abs error" in r.message


def test_float32_error_by_thousandth():
    # 1000 x 10.0, two elements 10.02: rel 0.002 >= 0.001 -> thousandth 998/1000 = 0.998 <= 0.999
    r = compare_output(filled(1000, 10.0, F64), filled(1000, 10.0, F32, [(0, 10.02), (1, 10.02)]))
    assert r.status == "error"
    assert "double-thousandth 0.998 <= 0.999 (float32; 2 of 1000" in r.message


def test_float32_thousandth_boundary_is_error():
    # one of 1000: thousandth exactly 0.999, which is not > 0.999
    r = compare_output(filled(1000, 10.0, F64), filled(1000, 10.0, F32, [(0, 10.02)]))
    assert r.status == "error" and "0.999 <= 0.999" in r.message


def test_float32_warning_by_ten_thousandth():
    # one of 1000 at 10.002: rel 2e-4 (< 0.001, >= 1e-4) -> thousandth 1.0, ten-thousandth 0.999 <= 0.9999
    r = compare_output(filled(1000, 10.0, F64), filled(1000, 10.0, F32, [(5, 10.002)]))
    assert r.status == "Warning" and "double-ten-thousandth 0.999 <= 0.9999" in r.message


def test_float32_pass_by_ten_thousandth():
    # one of 20000 at 10.002: ten-thousandth 19999/20000 = 0.99995 > 0.9999; max abs err 0.002 >= 0.001
    r = compare_output(filled(20000, 10.0, F64), filled(20000, 10.0, F32, [(5, 10.002)]))
    assert r.status == "pass" and "0.99995 > 0.9999" in r.message


def test_float64_uses_the_float32_branch():
    r = compare_output(filled(1000, 10.0, F64), filled(1000, 10.0, F64, [(0, 10.02), (1, 10.02)]))
    assert r.status == "error" and "(float64;" in r.message


def test_float16_error_by_hundredth():
    # 100 x 10.0, two at 10.5 (exact in float16): rel 0.05 -> hundredth 0.98 <= 0.99
    r = compare_output(filled(100, 10.0, F32), filled(100, 10.0, F16, [(0, 10.5), (1, 10.5)]))
    assert r.status == "error" and "double-hundredth 0.98 <= 0.99 (float16" in r.message


def test_float16_pass_and_warning_by_thousandth():
    # 10 + 3 * 2^-7 = 10.0234375 (float16 spacing in [8, 16) is 2^-7): rel 0.00234 -> inside 0.01, outside 0.001
    off = 10.0 + 3 * 2.0 ** -7
    one_of_2000 = compare_output(filled(2000, 10.0, F32), filled(2000, 10.0, F16, [(0, off)]))
    assert one_of_2000.status == "pass" and "double-thousandth 0.9995 > 0.999" in one_of_2000.message
    two_of_1000 = compare_output(filled(1000, 10.0, F32), filled(1000, 10.0, F16, [(0, off), (1, off)]))
    assert two_of_1000.status == "Warning" and "double-thousandth 0.998 <= 0.999 (float16" in two_of_1000.message


def test_bfloat16_warning():
    # bfloat16 spacing in [8, 16) is 2^-4: 10.0625; rel = 0.0625 / (10 + 2^-8) = 0.00625 (< 0.01, >= 0.001)
    r = compare_output(filled(1000, 10.0, F32), filled(1000, 10.0, BF16, [(0, 10.0625), (1, 10.0625)]))
    assert r.status == "Warning" and "(bfloat16" in r.message


def test_empty_and_one_element_float_outputs():
    assert compare_output(torch.empty(0, dtype=F32), torch.empty(0, dtype=F16)).status == "pass"
    # one element: cosine blank and passes; 2 vs 2.5 -> abs 0.5, rel 0.2 -> hundredth 0 <= 0.99 -> error
    r = compare_output(torch.tensor([2.0]), torch.tensor([2.5], dtype=F16))
    assert r.status == "error" and r.metrics.cosine is None and "double-hundredth 0 <= 0.99" in r.message


def test_complex_outputs():
    bench = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex128)
    assert compare_output(bench, bench.to(torch.complex64)).status == "pass"
    assert compare_output(bench, torch.ones(2, dtype=F32)).status == "error"  # complex against real


def test_shape_mismatch_is_error_even_when_bit_identical_to_the_same_dtype_run():
    """msprobe parity (issue 10 item 5): the bit-identical shortcut does not hide a shape or dtype-kind mismatch."""
    device = torch.ones(3, dtype=torch.float16)
    cmp = compare_output(torch.ones(2), device, [device.clone()])
    assert cmp.status == "error" and "shape mismatch" in cmp.message
    device = torch.ones(3, dtype=torch.int32)
    cmp = compare_output(torch.ones(3), device, [device.clone()])
    assert cmp.status == "error" and "dtype kind mismatch" in cmp.message


def test_two_way_error_that_a_correct_run_shares_is_pass():
    """An error/Warning that the same-dtype run (or a spread run) gets as well, with the device no further out,
    passes; a device further out keeps its status."""
    bench = torch.linspace(1, 2, 1000, dtype=torch.float64)
    same = (bench * (1 + 2.0 ** -9)).to(torch.float32)          # every element 0.2 % off: double-thousandth 0
    device = (bench * (1 + 2.0 ** -9.5)).to(torch.float32)
    assert compare_output(bench, same).status == "error"
    cmp = compare_output(bench, device, [same])
    assert cmp.status == "pass" and "a correct same-dtype run" in cmp.message
    assert compare_output(bench, (bench * 1.05).to(torch.float32), [same]).status == "error"   # cosine is fine,


@pytest.mark.parametrize("dtype, factor", [(torch.float32, 1 + 2.0 ** -8), (torch.bfloat16, 1.05),
                                           (torch.float16, 1 + 2.0 ** -5)])
def test_clearly_wrong_device_stays_error_with_correct_spread_runs(dtype, factor):
    """Issue 24: correct same-dtype runs (the host's and spread runs) forgive only what they share; a device output
    clearly further out than all of them stays error, however many there are."""
    torch.manual_seed(0)
    bench = torch.randn(4096, dtype=torch.float64) + 3.0
    spread = [(bench * (1 + i * 2.0 ** -30)).to(dtype) for i in range(4)]
    device = (bench * factor).to(dtype)
    assert compare_output(bench, device).status == "error"
    cmp = compare_output(bench, device, spread)
    assert cmp.status == "error", cmp.message
    assert compare_output(bench, spread[1], spread).status == "pass"
