"""Every threshold and constant of the comparison layer (docs/standards.md), as one named table: `THRESHOLDS`.

Nothing numeric that decides a metric or a verdict is written anywhere else: `gpu_server.metrics`,
`gpu_server.verdict` and the standards read it from here. The values are docs/standards.md's (msprobe's StandardConfig
and
CompareConst with the fixes docs/standards.md lists; docs/standards.md shows where they differ from msprobe).

Per-dtype rows are keyed by the DEVICE dtype. float64 has a row so that per-output metrics are defined for it
(it uses float64's own ULP parameters and float32's small-value, tolerance and ULP-threshold values); the
precision standards do not judge it (SKIP), so its standard-only fields are None. The float8 rows
(float8_e4m3fn, float8_e5m2) follow one rule in units of the format (docs/standards.md, fp8): small value = the
smallest normal, small atol = the subnormal spacing, rtol = eps (as float16), ratio floor = eps / 2 (as float16 and
bfloat16), the ULP threshold, share limit and two-way branch of the 16-bit formats.

The mixed-tolerance standard's per-dtype constants are one table, `MIXED_TOLERANCE` (Ascend's 2026 operator
standards); the benchmark standard's ratio tiers (msprobe 2026) are `BENCHMARK_TIERS`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Mapping

import torch


@dataclass(frozen=True)
class DtypeThresholds:
    """The parameters of one device dtype."""

    small_value: float          # |bench| <= small_value is a "small" element
    small_atol: float           # absolute tolerance of small elements (absolute-threshold and benchmark)
    rtol: float                 # relative tolerance of normal elements and of saturated inf/nan elements
    ulp_precision: int          # p: mantissa bits of the device format
    ulp_min_exponent: int       # min_eb: exponent of the smallest normal number
    ulp_threshold: float        # an element is "over" when its ULP error is strictly above this
    ratio_floor: float | None   # floor of the same-dtype metric in the ratio tests (benchmark, ULP)
    ulp_share_limit: float | None  # ULP standard passes when the over-threshold share is below this
    ulp_mean_limit: float | None   # ULP standard passes when the mean ULP error is below this (float32 only)
    low_precision: bool         # True: the float16/bfloat16 branch of the two-way status (docs/standards.md)
    eps: float | None = None    # fixed eps of the relative error; None = machine eps of the bench dtype


@dataclass(frozen=True)
class MixedTolerance:
    """One device dtype's constants of the mixed-tolerance standard: an element passes when |device - bench| <=
    atol + rtol * |bench|; the largest error must stay within max(floor, max_ulp ULP of the bench in the device
    format)."""

    atol: float
    rtol: float
    floor: float                # = atol (docs/standards.md, mixed tolerance: why)
    derived: bool = False       # True: not in Ascend's table, derived by its rule (atol = eps / 2, rtol = 2 eps)


@dataclass(frozen=True)
class Thresholds:
    per_dtype: Mapping[torch.dtype, DtypeThresholds]
    # Float dtypes the precision standards judge (others: SKIP "not supported by the precision standard").
    judged_dtypes: frozenset[torch.dtype]
    # Cosine similarity (two-way status): pass iff cosine > cosine_pass. A side whose max |value| is at most
    # cosine_zero counts as all-zero (msprobe's np.finfo(float).eps; it also keeps flushed subnormals "zero").
    cosine_pass: float
    cosine_zero: float
    # Two-way status: max abs error below this passes at once.
    max_abs_pass: float
    # Double-hundredth / -thousandth / -ten-thousandth: relative-error bound and the share that must exceed the pass
    # value (two-way status, strict >).
    hundredth: float
    hundredth_pass: float
    thousandth: float
    thousandth_pass: float
    ten_thousandth: float
    ten_thousandth_pass: float
    # Double-thousandth precision standard: passes iff the share >= this (msprobe's >=, docs/standards.md).
    thousandth_standard_pass: float
    # Benchmark standard: error when device metric / max(same metric, floor) exceeds the limit.
    benchmark_ratio_limits: Mapping[str, float]
    # ULP standard: passes when the share ratio is at most this (our fix, docs/standards.md: <=, msprobe <).
    ulp_ratio_limit: float
    # Elements processed at once in gpu_server.metrics (bounds the temporary memory).
    chunk_elements: int
    # Benchmark standard's tiers (msprobe 2026): tier -> the limits of benchmark_ratio_limits' keys. L0 is the
    # default and equals benchmark_ratio_limits.
    benchmark_tiers: Mapping[str, Mapping[str, float]]
    default_tier: str
    # Mixed-tolerance standard: per-dtype constants, the share of elements that must pass, the ULP limit of the
    # largest error.
    mixed_tolerance: Mapping[torch.dtype, MixedTolerance]
    mixed_pass_rate: float
    mixed_max_ulp: float
    # Quantisation standard: an element passes when |device - bench| <= this.
    quantisation_max_diff: float

    def for_dtype(self, dtype: torch.dtype) -> DtypeThresholds:
        """The row of a floating device dtype; other float formats (float8 ...) get the float16 row (8/16-bit
        formats) or the float32 row, with ULP parameters taken from torch.finfo of the format."""
        row = self.per_dtype.get(dtype)
        if row is not None:
            return row
        info = torch.finfo(dtype)
        base = self.per_dtype[torch.float16 if info.bits <= 16 else torch.float32]
        return replace(base, ulp_precision=round(-math.log2(info.eps)),
                       ulp_min_exponent=round(math.log2(info.tiny)))


THRESHOLDS = Thresholds(
    per_dtype=MappingProxyType({
        torch.float16: DtypeThresholds(
            small_value=2.0 ** -10, small_atol=2.0 ** -16, rtol=2.0 ** -10, ulp_precision=10, ulp_min_exponent=-14,
            ulp_threshold=1.0, ratio_floor=2.0 ** -11, ulp_share_limit=0.001, ulp_mean_limit=None, low_precision=True),
        torch.bfloat16: DtypeThresholds(
            small_value=2.0 ** -10, small_atol=2.0 ** -16, rtol=2.0 ** -8, ulp_precision=7, ulp_min_exponent=-126,
            ulp_threshold=1.0, ratio_floor=2.0 ** -8, ulp_share_limit=0.001, ulp_mean_limit=None, low_precision=True,
            eps=2.0 ** -8),
        torch.float32: DtypeThresholds(
            small_value=2.0 ** -20, small_atol=2.0 ** -30, rtol=2.0 ** -20, ulp_precision=23, ulp_min_exponent=-126,
            ulp_threshold=32.0, ratio_floor=2.0 ** -14, ulp_share_limit=0.05, ulp_mean_limit=64.0,
            low_precision=False),
        torch.float64: DtypeThresholds(
            small_value=2.0 ** -20, small_atol=2.0 ** -30, rtol=2.0 ** -20, ulp_precision=52, ulp_min_exponent=-1022,
            ulp_threshold=32.0, ratio_floor=None, ulp_share_limit=None, ulp_mean_limit=None, low_precision=False),
        # float8 (docs/standards.md, fp8): small value = smallest normal, small atol = subnormal spacing, rtol = eps,
        # ratio floor = eps / 2; p and min_eb from the format
        torch.float8_e4m3fn: DtypeThresholds(
            small_value=2.0 ** -6, small_atol=2.0 ** -9, rtol=2.0 ** -3, ulp_precision=3, ulp_min_exponent=-6,
            ulp_threshold=1.0, ratio_floor=2.0 ** -4, ulp_share_limit=0.001, ulp_mean_limit=None, low_precision=True),
        torch.float8_e5m2: DtypeThresholds(
            small_value=2.0 ** -14, small_atol=2.0 ** -16, rtol=2.0 ** -2, ulp_precision=2, ulp_min_exponent=-14,
            ulp_threshold=1.0, ratio_floor=2.0 ** -3, ulp_share_limit=0.001, ulp_mean_limit=None, low_precision=True),
    }),
    judged_dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2}),
    cosine_pass=0.99,
    cosine_zero=2.0 ** -52,
    max_abs_pass=0.001,
    hundredth=0.01,
    hundredth_pass=0.99,
    thousandth=0.001,
    thousandth_pass=0.999,
    ten_thousandth=0.0001,
    ten_thousandth_pass=0.9999,
    thousandth_standard_pass=0.999,
    benchmark_ratio_limits=MappingProxyType({"small_value": 2.0, "rmse": 2.0, "max_rel": 10.0, "mean_rel": 2.0}),
    ulp_ratio_limit=1.0,
    chunk_elements=1 << 22,
    benchmark_tiers=MappingProxyType({
        "L0": MappingProxyType({"small_value": 2.0, "rmse": 2.0, "max_rel": 10.0, "mean_rel": 2.0}),
        "L1": MappingProxyType({"small_value": 2.0, "rmse": 1.5, "max_rel": 5.0, "mean_rel": 1.5}),
        "L2": MappingProxyType({"small_value": 2.0, "rmse": 1.2, "max_rel": 2.0, "mean_rel": 1.2}),
    }),
    default_tier="L0",
    # Ascend's 2026 operator standards (atol, rtol); floor = atol; float8_e5m2 derived by e4m3's rule
    mixed_tolerance=MappingProxyType({
        torch.float16: MixedTolerance(atol=2.0 ** -9, rtol=2.0 ** -9, floor=2.0 ** -9),
        torch.bfloat16: MixedTolerance(atol=2.0 ** -6, rtol=2.0 ** -6, floor=2.0 ** -6),
        torch.float32: MixedTolerance(atol=2.0 ** -16, rtol=2.0 ** -10, floor=2.0 ** -16),
        torch.float8_e4m3fn: MixedTolerance(atol=2.0 ** -4, rtol=2.0 ** -2, floor=2.0 ** -4),
        torch.float8_e5m2: MixedTolerance(atol=2.0 ** -3, rtol=2.0 ** -1, floor=2.0 ** -3, derived=True),
    }),
    mixed_pass_rate=0.99,
    mixed_max_ulp=32.0,
    quantisation_max_diff=1.0,
)
assert THRESHOLDS.benchmark_tiers[THRESHOLDS.default_tier] == THRESHOLDS.benchmark_ratio_limits
