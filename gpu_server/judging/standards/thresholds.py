"""Every threshold and constant of the comparison layer (docs/standards.md), as one named table: `THRESHOLDS`.

Nothing numeric that decides a verdict is written anywhere else: `gpu_server.judging.verdict` and the standards read it
from
here. The values are docs/standards.md's (msprobe's StandardConfig and CompareConst with the fixes docs/standards.md
lists; docs/standards.md shows where they differ from msprobe).

The per-dtype rows (`per_dtype`, `for_dtype`) and the constants that define the metrics themselves (cosine, the
double-hundredth/-thousandth bounds, the chunk size) live one layer down, in gpu_server/judging/dtype_limits.py, so that
`gpu_server.judging.metrics` reads them without importing the standards; this table takes them from there.

The mixed-tolerance standard's per-dtype constants are one table, `MIXED_TOLERANCE` (Ascend's 2026 operator
standards); the benchmark standard's ratio tiers (msprobe 2026) are `BENCHMARK_TIERS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch

from gpu_server.judging.dtype_limits import (
    CHUNK_ELEMENTS,
    COSINE_PASS,
    COSINE_ZERO,
    HUNDREDTH,
    PER_DTYPE,
    TEN_THOUSANDTH,
    THOUSANDTH,
    DtypeThresholds,
    row_for,
)


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
    # Elements processed at once in gpu_server.judging.metrics (bounds the temporary memory).
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
        return row_for(dtype, self.per_dtype)


THRESHOLDS = Thresholds(
    per_dtype=PER_DTYPE,
    judged_dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2}),
    cosine_pass=COSINE_PASS,
    cosine_zero=COSINE_ZERO,
    max_abs_pass=0.001,
    hundredth=HUNDREDTH,
    hundredth_pass=0.99,
    thousandth=THOUSANDTH,
    thousandth_pass=0.999,
    ten_thousandth=TEN_THOUSANDTH,
    ten_thousandth_pass=0.9999,
    thousandth_standard_pass=0.999,
    benchmark_ratio_limits=MappingProxyType({"small_value": 2.0, "rmse": 2.0, "max_rel": 10.0, "mean_rel": 2.0}),
    ulp_ratio_limit=1.0,
    chunk_elements=CHUNK_ELEMENTS,
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
