"""The per-dtype parameters and constants the metrics need (gpu_server/judging/metrics.py), below the precision
standards.

The metrics of one output (ULP errors, small-value counts, tolerances, cosine, the double-hundredth/-thousandth
counts) are defined by these numbers; the standards judge those metrics with more thresholds of their own.
`gpu_server.judging.standards.thresholds.THRESHOLDS` collects all of them into one table (docs/standards.md) and takes
these
from here, so that the metrics never import the standards package (tests/test_import_graph.py keeps it so).

Per-dtype rows are keyed by the DEVICE dtype. float64 has a row so that per-output metrics are defined for it
(it uses float64's own ULP parameters and float32's small-value, tolerance and ULP-threshold values); the
precision standards do not judge it (SKIP), so its standard-only fields are None. The float8 rows
(float8_e4m3fn, float8_e5m2) follow one rule in units of the format (docs/standards.md, fp8): small value = the
smallest normal, small atol = the subnormal spacing, rtol = eps (as float16), ratio floor = eps / 2 (as float16 and
bfloat16), the ULP threshold, share limit and two-way branch of the 16-bit formats.
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


PER_DTYPE: Mapping[torch.dtype, DtypeThresholds] = MappingProxyType({
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
})


def row_for(dtype: torch.dtype, per_dtype: Mapping[torch.dtype, DtypeThresholds] = PER_DTYPE) -> DtypeThresholds:
    """The row of a floating device dtype; other float formats (float8 ...) get the float16 row (8/16-bit
    formats) or the float32 row, with ULP parameters taken from torch.finfo of the format."""
    row = per_dtype.get(dtype)
    if row is not None:
        return row
    info = torch.finfo(dtype)
    base = per_dtype[torch.float16 if info.bits <= 16 else torch.float32]
    return replace(base, ulp_precision=round(-math.log2(info.eps)),
                   ulp_min_exponent=round(math.log2(info.tiny)))


# Cosine similarity (two-way status): pass iff cosine > COSINE_PASS. A side whose max |value| is at most COSINE_ZERO
# counts as all-zero (msprobe's np.finfo(float).eps; it also keeps flushed subnormals "zero").
COSINE_PASS = 0.99
COSINE_ZERO = 2.0 ** -52
# Double-hundredth / -thousandth / -ten-thousandth: the relative-error bound each counts elements within.
HUNDREDTH = 0.01
THOUSANDTH = 0.001
TEN_THOUSANDTH = 0.0001
# Elements processed at once in gpu_server.judging.metrics (bounds the temporary memory).
CHUNK_ELEMENTS = 1 << 22
