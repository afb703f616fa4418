"""Non-finite values (docs/standards.md, "Non-finite values"): the device judged on its finite part where its
inf/NaN agree with the bench's, never forgiven where they disagree more than a correct run's, and the origin of a
training's first inf/NaN."""
from __future__ import annotations

import math

import torch

from gpu_server.judging.nonfinite import CallFiniteness, all_finite, bench_nonfinite
from gpu_server.judging.output_kind import bit_identical, classify
from gpu_server.judging.standards.judging import judge_pair
from gpu_server.judging.verdict import compare_pair

INF, NAN = math.inf, math.nan


def _status(bench, device, same):
    return compare_pair(classify(bench, device), [same])


def test_one_element_opposite_infinity_is_an_error_although_the_same_dtype_run_errs_too():
    bench = torch.tensor([INF], dtype=torch.float64)
    same = torch.tensor([INF], dtype=torch.float32)
    for device in (torch.tensor([-INF]), torch.tensor([1.0]), torch.tensor([NAN])):
        cmp = _status(bench, device, same)
        assert cmp.status == "error", (device, cmp.message)


def test_the_same_infinity_on_one_element_passes():
    cmp = _status(torch.tensor([INF], dtype=torch.float64), torch.tensor([INF]), torch.tensor([INF]))
    assert cmp.status == "pass"
    assert "in both" in cmp.message


def _overflowing_float16(seed: int):
    """A float16 output whose bench (float32) exceeds 65504 in a few places: inf in float16 on both sides; the
    finite part rounded correctly (device and same-dtype run round the bench to nearest)."""
    g = torch.Generator().manual_seed(seed)
    bench = torch.randn(4096, generator=g) * 100
    bench[[5, 77, 900]] = torch.tensor([70000.0, -80000.0, 1e6])
    device = bench.to(torch.float16)
    same = bench.double().to(torch.float16)
    return bench, device, same


def test_training_overflow_agreeing_with_the_bench_is_judged_on_the_finite_part():
    bench, device, same = _overflowing_float16(0)
    before = compare_pair(classify(bench, device), [])   # without a same-dtype run the rule applies alike
    assert before.status == "pass", before.message
    cmp = _status(bench, device, same)
    assert cmp.status == "pass", cmp.message
    assert "3 inf/NaN values in both" in cmp.message and "4093 finite elements" in cmp.message
    assert cmp.metrics is not None and cmp.metrics.cosine is None or math.isnan(cmp.metrics.cosine)


def test_a_wrong_finite_part_beside_agreeing_infinities_is_still_an_error():
    bench, device, same = _overflowing_float16(1)
    device = device.clone()
    device[1000:1400] = device[1000:1400] * 1.5
    cmp = _status(bench, device, same)
    assert cmp.status == "error", cmp.message
    assert "finite elements" in cmp.message


def test_infinities_at_other_positions_or_signs_are_an_error():
    bench, device, same = _overflowing_float16(2)
    flipped = device.clone()
    flipped[5] = -flipped[5]                     # -inf where the bench overflows to +inf
    assert _status(bench, flipped, same).status == "error"
    extra = device.clone()
    extra[10] = INF                              # inf where the bench is finite
    assert _status(bench, extra, same).status == "error"


def test_double_thousandth_fails_nan_on_the_device_alone():
    g = torch.Generator().manual_seed(3)
    bench = torch.randn(1, 4, 32, 32, generator=g)                    # a 4,096-element convolution output
    same = bench.to(torch.bfloat16)
    device = same.clone()
    device.view(-1)[[3, 400, 1000, 2000, 4000]] = NAN
    pair = classify(bench, device)
    verdict = judge_pair("conv2d", pair, same)
    assert verdict.algorithm == "双千指标法"
    assert verdict.status == "error", verdict.message
    clean = judge_pair("conv2d", classify(bench, same.clone()), same)
    assert clean.status == "pass", clean.message


def test_bit_identical_on_empty_views_with_stride_zero():
    t = torch.zeros(1).expand(0)
    assert bit_identical(t, t.clone())
    assert not bit_identical(torch.zeros(0, dtype=torch.float16), t)


def test_call_finiteness_tells_the_origin_and_whose_fault():
    x = torch.ones(4, dtype=torch.float16)
    finite_in = all_finite((x,))
    both = CallFiniteness.measure(finite_in, [torch.tensor([INF], dtype=torch.float16)], [torch.tensor([70000.0])])
    assert both.origin and both.device and both.bench and "own overflow" in both.verdict()
    device_only = CallFiniteness.measure(finite_in, [torch.tensor([NAN], dtype=torch.float16)], [torch.tensor([1.0])])
    assert device_only.origin and not device_only.bench and "device fault" in device_only.verdict()
    nan_in = all_finite((torch.tensor([NAN]),))
    carried = CallFiniteness.measure(nan_in, [torch.tensor([NAN])], [torch.tensor([NAN])])
    assert not carried.origin and not carried.inputs_finite
    assert all_finite({"a": [x, 3, None]}) and not all_finite((x, torch.tensor([INF])))
    assert not bench_nonfinite([torch.tensor([65000.0])], [torch.tensor([1.0], dtype=torch.float16)])


def _reference_finite(t: torch.Tensor, dtype=None) -> bool:
    """What `finite` must answer: every element, converted to `dtype`, finite (the element-by-element reading)."""
    return bool(torch.isfinite(t if dtype is None else t.to(dtype)).all())


def test_finite_from_the_extremes_agrees_with_reading_every_element():
    from gpu_server.judging.nonfinite import finite

    g = torch.Generator().manual_seed(0)
    checked = 0
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for n in (1, 2, 7, 16, 17, 33, 1000, 4099):
            for pos in sorted({0, n // 2, n - 1}):
                for value in (INF, -INF, NAN, None):
                    t = torch.randn(n, generator=g).to(dtype)
                    if value is not None:
                        t[pos] = value
                    views = [t, t[::2] if n > 1 else t, t.reshape(1, -1).t()]
                    for v in views:
                        assert finite(v) == _reference_finite(v), (dtype, n, pos, value)
                        checked += 1
    assert checked > 1000


def test_finite_in_a_narrower_dtype_sees_the_overflow_of_that_dtype_only():
    from gpu_server.judging.nonfinite import finite

    # float64 bench values above float16's largest (65504) and float32's: finite in float64, not in the narrower
    for big, narrow in ((70000.0, torch.float16), (1e39, torch.float32), (3.5e38, torch.bfloat16)):
        for sign in (1.0, -1.0):
            t = torch.tensor([0.5, sign * big, -2.0], dtype=torch.float64)
            assert finite(t)
            assert finite(t, narrow) is False == _reference_finite(t, narrow)
    t = torch.tensor([65504.0, -65504.0, 65519.0], dtype=torch.float64)   # 65519 still rounds to 65504
    assert finite(t, torch.float16) is True == _reference_finite(t, torch.float16)
    t = torch.tensor([65520.0], dtype=torch.float64)                         # rounds to inf
    assert finite(t, torch.float16) is False == _reference_finite(t, torch.float16)
    # types aminmax does not take are read element by element, with the same answers
    z = torch.tensor([1 + 1j, complex(INF, 0)], dtype=torch.complex64)
    assert finite(z) is False and finite(z[:1]) is True
    f8 = torch.tensor([1.0, 2.0]).to(torch.float8_e5m2)
    assert finite(f8) is True
    assert finite(torch.empty(0)) is True


def test_bench_nonfinite_and_all_finite_keep_their_answers():
    bench = [torch.tensor([1.0, 70000.0], dtype=torch.float32), torch.tensor([3], dtype=torch.int64)]
    assert bench_nonfinite(bench, [torch.tensor([1.0, 2.0], dtype=torch.float16), torch.tensor([3])])
    assert not bench_nonfinite(bench, [torch.tensor([1.0, 2.0], dtype=torch.float32), torch.tensor([3])])
    assert all_finite(((torch.ones(3), {"k": [torch.zeros(2, dtype=torch.bfloat16)]}), torch.tensor([1, 2])))
    assert not all_finite((torch.ones(3), {"k": [torch.tensor([1.0, NAN])]}))
