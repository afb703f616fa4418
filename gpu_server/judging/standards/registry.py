"""The registry of precision standards (in the shape of torch/utils/flop_counter.py's flop_registry).

Each standard is a small pure module that registers one judging function with `@register_standard(key, algorithm,
label, ratios=..., device_error=...)`. A judging function takes a `StandardInput` (the device dtype, the device
output's metrics against the bench and the same-dtype run's metrics against the bench) and returns a `StandardResult`
(its status, its cells of api_precision_compare_details keyed by column title, and its messages). The standard also
declares how the reports show it: its ratio columns with their limits and the device-vs-bench error column beside
them (gpu_server/reports/html.py reads them here, by algorithm name: `by_algorithm`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

import torch

if TYPE_CHECKING:
    from gpu_server.judging.metrics import OutputMetrics


@dataclass(frozen=True)
class StandardInput:
    dtype: torch.dtype | None        # the device output's dtype; None for a Python scalar
    device: OutputMetrics            # device output against the bench
    same: OutputMetrics | None       # same-dtype run against the bench; None when it is not available
    # the other spread members (gpu_server.replay.spread: stochastic-rounding same-dtype runs) against the bench
    spread: tuple = ()
    # the tensors themselves, for standards that judge elements rather than metrics (mixed tolerance,
    # quantisation); None where only metrics are known (the offline comparison of two details CSVs)
    bench: Any = None
    output: Any = None
    # a per-API configuration (selection.ApiJudging): this dtype's threshold overrides and the benchmark tier
    overrides: Mapping[str, float] = field(default_factory=dict)
    tier: str | None = None

    def param(self, name: str, default: float) -> float:
        """A threshold of this output: the per-API override when one is configured, else `default`."""
        return float(self.overrides.get(name, default))

    def members(self) -> list:
        """Every correct same-dtype implementation's metrics: the host's run first, then the spread runs."""
        return ([self.same] if self.same is not None else []) + list(self.spread)


@dataclass
class StandardResult:
    status: str                                          # PASS | ERROR | SKIP (gpu_server/statuses.py)
    cells: dict[str, str | float] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)


class Ratio(NamedTuple):
    """One column of api_precision_compare_details that the HTML report plots for a standard, and its limit."""

    column: str     # its title (gpu_server.columns: PRECISION_DETAILS_HEADER or PRECISION_EXTRA_COLUMNS)
    limit: float    # the error threshold drawn on its distribution (0: none drawn)


@dataclass(frozen=True)
class Standard:
    key: str
    algorithm: str                                       # msprobe's 比对算法 name
    judge: Callable[[StandardInput], StandardResult]
    label: str                                           # its name in the summaries (summary.json, the HTML)
    # its ratio columns, the most telling first (the HTML report: the failing calls' ratio, the distributions of the
    # first two, the worst ratio per step of the first)
    ratios: tuple[Ratio, ...] = ()
    # the accuracy_checking_details column of the device's error against the bench shown beside them (None: none)
    device_error: str | None = None


STANDARD_REGISTRY: dict[str, Standard] = {}


def register_standard(key: str, algorithm: str, label: str | None = None, *, ratios: tuple[Ratio, ...] = (),
                      device_error: str | None = None) -> Callable:
    """Decorator: register `fn(StandardInput) -> StandardResult` as the standard `key` (msprobe's name `algorithm`,
    `label` in the summaries, `key` by default; `ratios` and `device_error` for the HTML report, see Standard)."""

    def decorator(fn: Callable[[StandardInput], StandardResult]) -> Callable[[StandardInput], StandardResult]:
        if key in STANDARD_REGISTRY:
            raise ValueError(f"precision standard {key!r} registered twice")
        STANDARD_REGISTRY[key] = Standard(key, algorithm, fn, label or key, tuple(ratios), device_error)
        return fn

    return decorator


def by_algorithm() -> dict[str, Standard]:
    """msprobe's algorithm name (the 比对算法 cell) -> its standard."""
    return {s.algorithm: s for s in STANDARD_REGISTRY.values()}


def standard_labels() -> dict[str, str]:
    """msprobe's algorithm name (the 比对算法 cell) -> the standard's label in the summaries."""
    return {algorithm: s.label for algorithm, s in by_algorithm().items()}


def fmt(value: float | None) -> str:
    """A number in a message: enough digits to see on which side of a threshold it lies."""
    return "blank" if value is None else f"{value:.6g}"


def inf_nan_consistent(device_value: float, same_value: float | None) -> bool | None:
    """docs/standards.md: an inf/NaN device metric passes only if the same-dtype run has the same inf/NaN.
    None when the device metric is finite (the rule does not apply)."""
    if math.isfinite(device_value):
        return None
    if same_value is None:
        return False
    if math.isnan(device_value):
        return math.isnan(same_value)
    return device_value == same_value


def ratio_to_same(device_value: float, same_value: float, floor: float) -> float:
    """device metric / max(same-dtype metric, floor); a non-finite same-dtype metric is no reference a finite device
    metric can exceed (ratio 0)."""
    if not math.isfinite(same_value):
        return 0.0
    return abs(device_value) / max(abs(same_value), floor)


def spread_reference(values: list[float | None]) -> float:
    """The largest finite metric among the spread members (0 when none is finite)."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    return max(finite, default=0.0)


def share_bound_ratio(device_count: int, n: int, member_counts: list[tuple[int, int]], floor: float) -> float:
    """Lower confidence bound of the device's share over the largest upper bound of the members' shares (floored):
    a share of a few elements is judged by what it can be, not by its raw count."""
    low = wilson(device_count, n, upper=False)
    high = max((wilson(c, m, upper=True) for c, m in member_counts), default=0.0)
    return low / max(high, floor)


# -- confidence bounds of rates on few elements ---------------------------------------------------------------------
Z = 3.0   # two-sided ~99.7 %: a correct device gets a false error from one rate test about 1 time in 700 at most


def wilson(count: float, n: int, upper: bool, z: float = Z) -> float:
    """Wilson score bound of a binomial proportion count/n (upper or lower)."""
    if n <= 0:
        return 1.0 if upper else 0.0
    p = count / n
    denom = 1 + z * z / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + half) / denom) if upper else max(0.0, (centre - half) / denom)
