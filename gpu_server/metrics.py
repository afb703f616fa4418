"""Per-output metrics of SPEC §6.1: pure functions of (bench, device) tensors, no I/O.

`bench` is the upcast bench output (float32 for a float16/bfloat16 device output, float64 for float32), `device`
the device output in its own dtype. Every parameter follows the DEVICE dtype (gpu_server.standards.thresholds),
except the eps of the relative error, which SPEC §6.1 defines as 2^-8 for a bfloat16 device and otherwise the
machine epsilon of the BENCH dtype (2^-23 for float16 outputs, 2^-52 for float32 outputs).

All statistics are accumulated in float64 with vectorised torch ops on the bench tensor's device, chunk by chunk
(THRESHOLDS.chunk_elements) so that temporaries stay bounded for large outputs.

Conventions (where SPEC and msprobe are silent):
- Empty outputs: double-x ratios 1, error rates and shares 0, max/mean/RMSE 0, cosine blank (None).
- float64 device outputs: every metric is computed, with float64's own eps (2^-52) and ULP parameters
  (p 52, min_eb -1022) and float32's small value (2^-20), tolerances (rtol 2^-20, small atol 2^-30) and ULP
  threshold (32). The precision standards do not judge float64 (SKIP); the two-way status does.
- Other float formats (float8 ...): the float16 row (8/16-bit) or the float32 row, ULP parameters from torch.finfo.
- Complex outputs are compared as their real and imaginary parts (torch.view_as_real) with the parameters of the
  real dtype.
- Integer and bool outputs: only binary_error_rate.
- Binary consistency counts an element as consistent when both sides are NaN (like "both NaN passes" of the inf/nan
  error rate); everything else compares with `!=` (so -0.0 equals 0.0).
- ULP error: eb = floor(log2|bench|) from the exact frexp exponent, eb = min_eb where bench == 0 (SPEC fix), and
  NaN where the bench is inf or NaN (msprobe's inf * 0); NaN elements make the max and mean NaN and are not
  counted as over the threshold. A finite bench against an infinite device gives an infinite ULP error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from gpu_server.standards.thresholds import THRESHOLDS, DtypeThresholds


@dataclass(frozen=True)
class OutputMetrics:
    """One details row's metric cells (gpu_server.columns.METRIC_COLUMNS, same names and order); None = blank."""

    cosine: float | None = None
    max_abs_err: float | None = None
    hundredth: float | None = None
    thousandth: float | None = None
    ten_thousandth: float | None = None
    binary_error_rate: float | None = None
    error_balance: float | None = None
    rmse: float | None = None
    small_value_error_ratio: float | None = None
    max_rel_err: float | None = None
    mean_rel_err: float | None = None
    inf_nan_error_rate: float | None = None
    rel_err_rate: float | None = None
    abs_err_rate: float | None = None
    ulp_max: float | None = None
    ulp_mean: float | None = None
    ulp_over_threshold: float | None = None
    # Element counts behind the shares and rates (not a report column): numel, small, small_bad, ulp_over,
    # hundredth, thousandth, ten_thousandth. The verdict's confidence bounds need them (gpu_server.spread.wilson).
    counts: Mapping[str, int] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class CosineCheck:
    """The cosine gate of SPEC §6.2 including its blank cases (the value alone cannot tell them apart)."""

    value: float | None  # None: blank cell (one element, empty, or an all-zero side)
    passed: bool         # pass iff value > 0.99, or a blank case that passes
    note: str            # why a blank case passes or fails; "" otherwise


@dataclass(frozen=True)
class Analysis:
    metrics: OutputMetrics
    cosine: CosineCheck
    numel: int
    device_dtype: torch.dtype  # the dtype whose parameters applied (the real dtype for complex outputs)
    is_float: bool


def dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer/bool"


def mismatch(bench: torch.Tensor, device: torch.Tensor) -> str | None:
    """Why two tensors cannot be compared element by element (shape, dtype kind), or None when they can."""
    if tuple(bench.shape) != tuple(device.shape):
        return f"shape mismatch: bench {tuple(bench.shape)} vs device {tuple(device.shape)}"
    if dtype_kind(bench.dtype) != dtype_kind(device.dtype):
        return (f"dtype kind mismatch: bench {bench.dtype} ({dtype_kind(bench.dtype)}) vs device {device.dtype} "
                f"({dtype_kind(device.dtype)}), cannot compare")
    return None


def scalar_error_rate(bench: object, device: object) -> float:
    """Binary error rate of two Python values: 0.0 when they have the same type and are equal (both NaN counts as
    equal), else 1.0."""
    if type(bench) is not type(device):
        return 1.0
    if isinstance(bench, float) and math.isnan(bench) and math.isnan(device):
        return 0.0
    return 0.0 if bench == device else 1.0


def output_metrics(bench: torch.Tensor, device: torch.Tensor) -> OutputMetrics:
    """SPEC §6.1 metrics of one output. Raises ValueError only for a shape mismatch or complex against real (a float
    bench against an integer device output is compared by value: binary error rate only)."""
    return analyse(bench, device).metrics


def analyse(bench: torch.Tensor, device: torch.Tensor, chunk_elements: int | None = None) -> Analysis:
    """output_metrics plus what the two-way status needs (the cosine gate's blank cases)."""
    if tuple(bench.shape) != tuple(device.shape) or bench.dtype.is_complex != device.dtype.is_complex:
        raise ValueError(mismatch(bench, device))
    if device.dtype.is_complex:
        bench, device = torch.view_as_real(bench.resolve_conj()), torch.view_as_real(device.resolve_conj())
    device = device.detach().to(bench.device)
    bench = bench.detach()
    chunk = chunk_elements or THRESHOLDS.chunk_elements
    numel = device.numel()
    if not device.dtype.is_floating_point:
        rate = _binary_error_rate(bench.reshape(-1), device.reshape(-1), chunk)
        return Analysis(OutputMetrics(binary_error_rate=rate), CosineCheck(None, True, ""), numel, device.dtype, False)
    if numel == 0:
        return Analysis(_empty_metrics(), CosineCheck(None, True, "empty output"), 0, device.dtype, True)
    acc = _Accumulator(bench.dtype, device.dtype)
    flat_b, flat_d = bench.reshape(-1), device.reshape(-1)
    bmax = dmax = torch.zeros((), dtype=torch.float64, device=bench.device)
    for start in range(0, numel, chunk):  # pass 1: the max |value| of each side (cosine normalisation)
        bmax = torch.maximum(bmax, flat_b[start:start + chunk].double().abs().max())
        dmax = torch.maximum(dmax, flat_d[start:start + chunk].double().abs().max())
    acc.set_norms(bmax, dmax)
    for start in range(0, numel, chunk):
        acc.add(flat_b[start:start + chunk], flat_d[start:start + chunk])
    return Analysis(acc.metrics(numel), acc.cosine(numel), numel, device.dtype, True)


def _empty_metrics() -> OutputMetrics:
    return OutputMetrics(cosine=None, max_abs_err=0.0, hundredth=1.0, thousandth=1.0, ten_thousandth=1.0,
                         binary_error_rate=0.0, error_balance=0.0, rmse=0.0, small_value_error_ratio=0.0,
                         max_rel_err=0.0, mean_rel_err=0.0, inf_nan_error_rate=0.0, rel_err_rate=0.0,
                         abs_err_rate=0.0, ulp_max=0.0, ulp_mean=0.0, ulp_over_threshold=0.0)


def _comparable_int(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint64:
        return t.view(torch.int64)  # bit pattern: equality is preserved
    return t.to(torch.int64) if not t.dtype.is_floating_point else t.double()


def _binary_error_rate(bench: torch.Tensor, device: torch.Tensor, chunk: int) -> float:
    numel = device.numel()
    if numel == 0:
        return 0.0
    differ = 0
    same_dtype = bench.dtype == device.dtype
    for start in range(0, numel, chunk):
        b, d = bench[start:start + chunk], device[start:start + chunk]
        if not same_dtype:
            b, d = _comparable_int(b), _comparable_int(d)
        differ += int((b != d).sum())
    return differ / numel


def _ratio(count: int, total: int, empty: float) -> float:
    return count / total if total else empty


class _Accumulator:
    """Float64 running sums and counts over the chunks of one output."""

    def __init__(self, bench_dtype: torch.dtype, device_dtype: torch.dtype):
        self.device_dtype = device_dtype
        self.p: DtypeThresholds = THRESHOLDS.for_dtype(device_dtype)
        bench_float = bench_dtype if bench_dtype.is_floating_point else torch.float64
        self.eps = self.p.eps if self.p.eps is not None else torch.finfo(bench_float).eps
        info = torch.finfo(device_dtype)
        self.lo, self.hi = info.min, info.max
        self.counts = dict.fromkeys(("hundredth", "thousandth", "ten_thousandth", "binary", "above", "below",
                                     "small", "small_bad", "normal", "rel_bad", "inf_nan", "inf_nan_bad",
                                     "ulp_over"), 0)
        zero = torch.zeros((), dtype=torch.float64)
        self.sums = {k: zero for k in ("sq", "rel", "ulp", "dot", "bb", "dd")}
        self.maxima = {k: torch.full((), -math.inf, dtype=torch.float64) for k in ("abs", "rel", "ulp")}
        self.bmax = self.dmax = zero

    def set_norms(self, bmax: torch.Tensor, dmax: torch.Tensor) -> None:
        self.bmax, self.dmax = bmax, dmax

    def _count(self, key: str, mask: torch.Tensor) -> None:
        self.counts[key] += int(mask.sum())

    def _sum(self, key: str, values: torch.Tensor) -> None:
        self.sums[key] = self.sums[key].to(values.device) + values.sum()

    def _max(self, key: str, values: torch.Tensor) -> None:
        self.maxima[key] = torch.maximum(self.maxima[key].to(values.device), values.max())  # NaN propagates

    def add(self, bench: torch.Tensor, device: torch.Tensor) -> None:
        p, t = self.p, THRESHOLDS
        b, d = bench.double(), device.double()
        golden = bench.to(self.device_dtype).double()  # the bench in the device dtype (finiteness, saturation)
        abs_b = b.abs()
        abs_err = (d - b).abs()
        rel = abs_err / (abs_b + self.eps)
        self._max("abs", abs_err)
        self._count("hundredth", rel < t.hundredth)
        self._count("thousandth", rel < t.thousandth)
        self._count("ten_thousandth", rel < t.ten_thousandth)
        both_nan = torch.isnan(b) & torch.isnan(d)
        self._count("binary", (d != b) & ~both_nan)
        self._count("above", d > b)
        self._count("below", d < b)

        finite = torch.isfinite(d) & torch.isfinite(golden)
        inf_nan = ~finite
        small = finite & (abs_b <= p.small_value)
        normal = finite & ~small
        self._count("small", small)
        self._count("small_bad", small & (abs_err > p.small_atol))
        self._count("normal", normal)
        self._count("rel_bad", normal & (rel > p.rtol))
        self._sum("sq", torch.where(normal, abs_err, 0.0).square())
        self._sum("rel", torch.where(normal, rel, 0.0))
        self._max("rel", torch.where(normal, rel, -1.0))

        # inf/nan elements: saturated values within rtol relative, or both NaN; an infinite bench needs the
        # same infinity on the device (SPEC fix: msprobe passed any finite value there).
        saturated = (d.clamp(self.lo, self.hi) - golden.clamp(self.lo, self.hi)).abs() / (abs_b + self.eps)
        ok = (saturated <= p.rtol) | (torch.isnan(d) & torch.isnan(golden))
        ok = torch.where(torch.isinf(b), d == b, ok)
        self._count("inf_nan", inf_nan)
        self._count("inf_nan_bad", inf_nan & ~ok)

        # ULP: eb = floor(log2|bench|) = frexp exponent - 1, min_eb where bench == 0 (SPEC fix), NaN for inf/NaN
        # bench. Scaled in two steps so that float64's 2^(52 + 1022) cannot overflow.
        _, exponent = torch.frexp(b)
        eb = torch.where(b == 0, p.ulp_min_exponent, exponent.double() - 1).clamp_min(p.ulp_min_exponent)
        ulp = abs_err * torch.exp2(-eb) * (2.0 ** p.ulp_precision)
        ulp = torch.where(torch.isfinite(b), ulp, math.nan)
        self._max("ulp", ulp)
        self._sum("ulp", ulp)
        self._count("ulp_over", ulp > p.ulp_threshold)

        bn, dn = b / self.bmax, d / self.dmax
        self._sum("dot", bn * dn)
        self._sum("bb", bn.square())
        self._sum("dd", dn.square())

    def cosine(self, numel: int) -> CosineCheck:
        zero = THRESHOLDS.cosine_zero
        if numel == 1:
            return CosineCheck(None, True, "one element: cosine similarity not applicable")
        bmax, dmax = float(self.bmax), float(self.dmax)
        if bmax <= zero and dmax <= zero:
            return CosineCheck(None, True, "bench and device outputs are all zero")
        if dmax <= zero:
            return CosineCheck(None, False, "device output is all zero, bench output is not")
        if bmax <= zero:
            return CosineCheck(None, False, "bench output is all zero, device output is not")
        cos = float(self.sums["dot"] / (self.sums["bb"].sqrt() * self.sums["dd"].sqrt()))
        if math.isnan(cos):
            return CosineCheck(cos, False, "cosine similarity is NaN (inf or NaN in the outputs)")
        cos = min(1.0, max(-1.0, cos))
        return CosineCheck(cos, cos > THRESHOLDS.cosine_pass, "")

    def metrics(self, numel: int) -> OutputMetrics:
        c = self.counts
        rel_max = float(self.maxima["rel"])
        return OutputMetrics(
            cosine=self.cosine(numel).value,
            max_abs_err=float(self.maxima["abs"]),
            hundredth=c["hundredth"] / numel,
            thousandth=c["thousandth"] / numel,
            ten_thousandth=c["ten_thousandth"] / numel,
            binary_error_rate=c["binary"] / numel,
            error_balance=abs(c["above"] - c["below"]) / numel,
            rmse=math.sqrt(float(self.sums["sq"]) / c["normal"]) if c["normal"] else 0.0,
            small_value_error_ratio=_ratio(c["small_bad"], c["small"], 0.0),
            max_rel_err=rel_max if rel_max >= 0 else 0.0,
            mean_rel_err=_ratio(float(self.sums["rel"]), c["normal"], 0.0),
            inf_nan_error_rate=_ratio(c["inf_nan_bad"], c["inf_nan"], 0.0),
            rel_err_rate=_ratio(c["rel_bad"], c["normal"], 0.0),
            abs_err_rate=_ratio(c["small_bad"], c["small"], 0.0),
            ulp_max=float(self.maxima["ulp"]),
            ulp_mean=float(self.sums["ulp"]) / numel,
            ulp_over_threshold=c["ulp_over"] / numel,
            counts={"numel": numel, **{k: c[k] for k in ("small", "small_bad", "ulp_over", "hundredth", "thousandth",
                                                         "ten_thousandth")}},
        )
