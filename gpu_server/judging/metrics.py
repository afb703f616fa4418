"""Per-output metrics of docs/standards.md: pure functions of (bench, device) tensors, no I/O.

`bench` is the upcast bench output (float32 for a float16/bfloat16 device output, float64 for float32), `device`
the device output in its own dtype. Every parameter follows the DEVICE dtype (gpu_server.judging.dtype_limits),
except the eps of the relative error, which docs/standards.md defines as 2^-8 for a bfloat16 device and otherwise the
machine epsilon of the BENCH dtype (2^-23 for float16 outputs, 2^-52 for float32 outputs).

All statistics are accumulated in float64 with vectorised torch ops on the bench tensor's device, chunk by chunk
(CHUNK_ELEMENTS) so that temporaries stay bounded for large outputs; each chunk's sums are taken tile by tile
(`_tiled_sum`), the same way in every path.

Conventions (where msprobe is silent):
- Empty outputs: double-x ratios 1, error rates and shares 0, max/mean/RMSE 0, cosine blank (None).
- float64 device outputs: every metric is computed, with float64's own eps (2^-52) and ULP parameters
  (p 52, min_eb -1022) and float32's small value (2^-20), tolerances (rtol 2^-20, small atol 2^-30) and ULP
  threshold (32). The precision standards do not judge float64 (SKIP); the two-way status does.
- float8_e4m3fn / float8_e5m2 have rows of their own (gpu_server.judging.dtype_limits); other float formats (float8
  ...fnuz): the float16 row (8/16-bit) or the float32 row, ULP parameters from torch.finfo. One-byte float outputs are
  widened to float32 (exactly) before any arithmetic: torch has few kernels for them; the parameters stay the format's.
- Complex outputs are compared as their real and imaginary parts (torch.view_as_real) with the parameters of the
  real dtype.
- Integer and bool outputs: only binary_error_rate.
- Binary consistency counts an element as consistent when both sides are NaN (like "both NaN passes" of the inf/nan
  error rate); everything else compares with `!=` (so -0.0 equals 0.0).
- ULP error: eb = floor(log2|bench|) from the exact frexp exponent, eb = min_eb where bench == 0 (our fix,
docs/standards.md), and
  NaN where the bench is inf or NaN (msprobe's inf * 0); NaN elements make the max and mean NaN and are not
  counted as over the threshold. A finite bench against an infinite device gives an infinite ULP error.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy
import torch

from gpu_server.judging import extremes, metric_kernel
from gpu_server.judging.bits import same_bits
from gpu_server.judging.dtype_limits import (
    CHUNK_ELEMENTS,
    COSINE_PASS,
    COSINE_ZERO,
    HUNDREDTH,
    TEN_THOUSANDTH,
    THOUSANDTH,
    DtypeThresholds,
    row_for,
)


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
    # hundredth, thousandth, ten_thousandth, inf_nan (elements non-finite on either side, the bench in the device
    # dtype) and inf_nan_bad (those that disagree: another class or sign, a finite value not saturated). The
    # confidence bounds and the non-finite rules need them (standards.registry.wilson, gpu_server/judging/verdict.py).
    counts: Mapping[str, int] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class CosineCheck:
    """The cosine gate of docs/standards.md including its blank cases (the value alone cannot tell them apart)."""

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
    """docs/standards.md metrics of one output. Raises ValueError only for a shape mismatch or complex against real (a
    float
    bench against an integer device output is compared by value: binary error rate only)."""
    return analyse(bench, device).metrics


def analyse(bench: torch.Tensor, device: torch.Tensor, chunk_elements: int | None = None) -> Analysis:
    """output_metrics plus what the two-way status needs (the cosine gate's blank cases). Inside `shared()`, a pair
    already analysed (by `prefetch` or an earlier call) is not computed again."""
    memo = getattr(_local, "memo", None)
    key = (id(bench), id(device), chunk_elements)
    if memo is not None:
        hit = memo.get(key)
        if hit is not None and hit[0] is bench and hit[1] is device:
            return hit[2]
    result = _analyse_one(bench, device, chunk_elements)
    if memo is not None:
        memo[key] = (bench, device, result)
    return result


_local = threading.local()


def shared() -> contextlib.AbstractContextManager[None]:
    """Within this block (one output of one call, one thread), `analyse` of a (bench, other) pair seen before returns
    the earlier result: the two-way status, the spread rule and the precision standard each ask for the same pairs."""
    return extremes.memo_block(_local)


def prefetch(bench: Any, others: list) -> None:
    """Analyse several outputs (the device's, the same-dtype run's) against one bench in one pass over the bench:
    its per-element terms (|bench|, ULP spacing, small-value mask, cosine normalisation) are computed once per chunk.
    Results go to the `shared()` memo (no-op outside it); pairs that are not plain float comparisons are left to
    `analyse`, which raises or handles them as usual. The values are exactly those `analyse` computes alone."""
    memo = getattr(_local, "memo", None)
    if memo is None or not isinstance(bench, torch.Tensor) or bench.dtype.is_complex:
        return
    group = [o for o in others if isinstance(o, torch.Tensor) and o.dtype.is_floating_point and o.numel()
             and tuple(o.shape) == tuple(bench.shape) and (id(bench), id(o), None) not in memo]
    by_dtype: dict[torch.dtype, list] = {}
    twins: list[tuple[torch.Tensor, torch.Tensor]] = []   # (output, an earlier output with the same bits)
    for o in group:
        seen = by_dtype.setdefault(o.dtype, [])
        twin = next((x for x in seen if x is o or same_bits(x, o)), None)
        if twin is None:
            seen.append(o)
        elif twin is not o:
            twins.append((o, twin))
    for members in by_dtype.values():
        for o, result in zip(members, _analyse_floats(bench, members, CHUNK_ELEMENTS)):
            memo[(id(bench), id(o), None)] = (bench, o, result)
    for o, twin in twins:   # bit-identical outputs have identical metrics: computed once
        memo[(id(bench), id(o), None)] = (bench, o, memo[(id(bench), id(twin), None)][2])


def analyse_with(bench: torch.Tensor, device: torch.Tensor, row: DtypeThresholds) -> Analysis:
    """`analyse` with another parameter row for the device dtype (a per-API threshold override,
    gpu_server.judging.standards.selection.configure); never memoised."""
    return _analyse_one(bench, device, None, row)


def _analyse_one(bench: torch.Tensor, device: torch.Tensor, chunk_elements: int | None,
                 row: DtypeThresholds | None = None) -> Analysis:
    if tuple(bench.shape) != tuple(device.shape) or bench.dtype.is_complex != device.dtype.is_complex:
        raise ValueError(mismatch(bench, device))
    if device.dtype.is_complex:
        bench, device = torch.view_as_real(bench.resolve_conj()), torch.view_as_real(device.resolve_conj())
    chunk = chunk_elements or CHUNK_ELEMENTS
    numel = device.numel()
    if not device.dtype.is_floating_point:
        device = device.detach().to(bench.device)
        rate = _binary_error_rate(bench.detach().reshape(-1), device.reshape(-1), chunk)
        return Analysis(OutputMetrics(binary_error_rate=rate), CosineCheck(None, True, ""), numel, device.dtype, False)
    if numel == 0:
        return Analysis(_empty_metrics(), CosineCheck(None, True, "empty output"), 0, device.dtype, True)
    return _analyse_floats(bench, [device], chunk, row)[0]


def _absmax(chunk: torch.Tensor) -> torch.Tensor:
    """max |x| of a chunk as a float64 0-dim tensor (NaN if any NaN), in one pass without a copy of a float chunk
    (max |x| is max(|min x|, |max x|); aminmax propagates NaN)."""
    if chunk.dtype.is_floating_point:
        if chunk.numel() == 0:
            return chunk.abs().max().double()   # raises like before
        lo, hi = extremes.aminmax(chunk)   # a whole output's: the finiteness check's (judging/extremes.py)
        return torch.maximum(lo.abs(), hi.abs()).double()
    return chunk.double().abs().max()


_FAST_LIMIT = 2.0 ** 900   # below this, |device - bench| / eps cannot overflow float64


def _analyse_floats(bench: torch.Tensor, devices: list, chunk: int, row: DtypeThresholds | None = None
                    ) -> list[Analysis]:
    """Float metrics of several non-empty float outputs of one dtype and of the bench's shape against the bench."""
    bench = bench.detach()
    flat_b = bench.reshape(-1)
    device_dtype = devices[0].dtype
    flat_ds = [_widened(d.detach().to(bench.device).reshape(-1)) for d in devices]
    numel = flat_b.numel()
    zero = torch.zeros((), dtype=torch.float64, device=bench.device)
    bmax, dmaxs = zero, [zero] * len(flat_ds)
    for start in range(0, numel, chunk):  # pass 1: the max |value| of each side (cosine normalisation)
        bmax = torch.maximum(bmax, _absmax(flat_b[start:start + chunk]))
        dmaxs = [torch.maximum(m, _absmax(d[start:start + chunk])) for m, d in zip(dmaxs, flat_ds)]
    maxima = torch.stack([bmax, *dmaxs]).tolist()   # one transfer for every side
    golden_max = float(torch.tensor(maxima[0], dtype=torch.float64).to(device_dtype))
    bench_ok = maxima[0] < _FAST_LIMIT and math.isfinite(golden_max)
    accs, fast = [], []
    for dmax, dmax_value in zip(dmaxs, maxima[1:]):
        acc = _Accumulator(bench.dtype, device_dtype, row)
        acc.set_norms(bmax, dmax, maxima[0], dmax_value)
        accs.append(acc)
        # every element finite on both sides and in the device dtype: the inf/nan terms are all zero
        fast.append(bench_ok and dmax_value < _FAST_LIMIT)
    quick = [(acc, d) for acc, d, q in zip(accs, flat_ds, fast) if q]
    slow = [(acc, d) for acc, d, q in zip(accs, flat_ds, fast) if not q]
    for start in range(0, numel, chunk):
        stop = min(numel, start + chunk)
        if quick:
            _add_finite_chunk(flat_b, quick, bmax, start, stop)
        for acc, d in slow:
            acc.add(flat_b[start:stop], d[start:stop])
    return [Analysis(acc.metrics(numel), acc.cosine(numel), numel, device_dtype, True) for acc in accs]


def _widened(t: torch.Tensor) -> torch.Tensor:
    """A one-byte float (float8) as float32, exactly; other tensors as they are."""
    return t.float() if t.is_floating_point() and t.element_size() == 1 else t


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
        differ += int(torch.count_nonzero(b != d))
    return differ / numel


def _ratio(count: int, total: int, empty: float) -> float:
    return count / total if total else empty


class _Accumulator:
    """Float64 running sums and counts over the chunks of one output."""

    def __init__(self, bench_dtype: torch.dtype, device_dtype: torch.dtype, row: DtypeThresholds | None = None):
        self.device_dtype = device_dtype
        self.p: DtypeThresholds = row or row_for(device_dtype)
        bench_float = bench_dtype if bench_dtype.is_floating_point else torch.float64
        self.eps = self.p.eps if self.p.eps is not None else torch.finfo(bench_float).eps
        info = torch.finfo(device_dtype)
        self.lo, self.hi = info.min, info.max
        self.counts = dict.fromkeys(("hundredth", "thousandth", "ten_thousandth", "binary", "above", "below",
                                     "small", "small_bad", "normal", "rel_bad", "inf_nan", "inf_nan_bad",
                                     "ulp_over"), 0)
        # Python numbers while only the compiled pass adds to them (its counts, maxima and tile sums come back as
        # numbers: the same float64 additions, no torch call per statistic); a torch pass makes them 0-dim tensors
        self.sums: dict[str, Any] = dict.fromkeys(("sq", "rel", "ulp", "dot", "bb", "dd"), 0.0)
        self.maxima: dict[str, Any] = dict.fromkeys(("abs", "rel", "ulp"), -math.inf)
        zero = torch.zeros((), dtype=torch.float64)
        self.bmax = self.dmax = zero
        self.norms = (0.0, 0.0)   # bmax and dmax as numbers
        self._resolved: tuple[dict[str, int], dict[str, float]] | None = None

    def set_norms(self, bmax: torch.Tensor, dmax: torch.Tensor, bmax_value: float, dmax_value: float) -> None:
        self.bmax, self.dmax, self.norms = bmax, dmax, (bmax_value, dmax_value)

    def _count(self, key: str, mask: torch.Tensor) -> None:
        self.counts[key] = self.counts[key] + torch.count_nonzero(mask)   # a tensor: no device sync per count

    def _sum(self, key: str, values: torch.Tensor) -> None:
        self.sums[key] = _on(self.sums[key], values.device) + _tiled_sum(values)

    def _max(self, key: str, values: torch.Tensor) -> None:
        self.maxima[key] = torch.maximum(_on(self.maxima[key], values.device), values.max())  # NaN propagates

    def add(self, bench: torch.Tensor, device: torch.Tensor) -> None:
        p = self.p
        b, d = bench.double(), device.double()
        # the bench in the device dtype (finiteness, saturation)
        golden = _widened(bench.to(self.device_dtype)).double()
        abs_b = b.abs()
        abs_err = (d - b).abs()
        rel = abs_err / (abs_b + self.eps)
        self._max("abs", abs_err)
        self._count("hundredth", rel < HUNDREDTH)
        self._count("thousandth", rel < THOUSANDTH)
        self._count("ten_thousandth", rel < TEN_THOUSANDTH)
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
        # same infinity on the device (our fix, docs/standards.md: msprobe passed any finite value there).
        saturated = (d.clamp(self.lo, self.hi) - golden.clamp(self.lo, self.hi)).abs() / (abs_b + self.eps)
        ok = (saturated <= p.rtol) | (torch.isnan(d) & torch.isnan(golden))
        ok = torch.where(torch.isinf(b), d == b, ok)
        self._count("inf_nan", inf_nan)
        self._count("inf_nan_bad", inf_nan & ~ok)

        # ULP: eb = floor(log2|bench|) = frexp exponent - 1, min_eb where bench == 0 (our fix, docs/standards.md), NaN
        # for inf/NaN
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

    def _resolve(self) -> tuple[dict[str, int], dict[str, float]]:
        """Every count and float statistic as Python numbers, in two transfers (no device sync per statistic)."""
        if self._resolved is None:
            names = list(self.counts)
            parts = [*self.counts.values(), *self.sums.values(), *self.maxima.values()]
            if not any(isinstance(v, torch.Tensor) for v in parts):   # the compiled pass alone: numbers already
                s = {k: numpy.float64(v) for k, v in self.sums.items()}
                with numpy.errstate(divide="ignore", invalid="ignore"):   # as torch: 0 / 0 is NaN, x / 0 inf
                    cos = float(s["dot"] / (numpy.sqrt(s["bb"]) * numpy.sqrt(s["dd"])))
                floats = {"bmax": self.norms[0], "dmax": self.norms[1], "cos": cos,
                          **{f"sum_{k}": float(v) for k, v in self.sums.items()},
                          **{f"max_{k}": float(v) for k, v in self.maxima.items()}}
                self._resolved = ({k: int(self.counts[k]) for k in names}, floats)
                return self._resolved
            dev = self.bmax.device
            ints = torch.stack([torch.as_tensor(self.counts[k], dtype=torch.int64, device=dev) for k in names])
            sums = {k: _on(v, dev) for k, v in self.sums.items()}
            cos = sums["dot"] / (sums["bb"].sqrt() * sums["dd"].sqrt())
            tensors = {"bmax": self.bmax, "dmax": self.dmax, "cos": cos, **{f"sum_{k}": v for k, v in sums.items()},
                       **{f"max_{k}": _on(v, dev) for k, v in self.maxima.items()}}
            values = torch.stack([v.to(device=dev, dtype=torch.float64) for v in tensors.values()]).tolist()
            self._resolved = (dict(zip(names, ints.tolist())), dict(zip(tensors, values)))
        return self._resolved

    def cosine(self, numel: int) -> CosineCheck:
        zero = COSINE_ZERO
        if numel == 1:
            return CosineCheck(None, True, "one element: cosine similarity not applicable")
        f = self._resolve()[1]
        bmax, dmax = f["bmax"], f["dmax"]
        if bmax <= zero and dmax <= zero:
            return CosineCheck(None, True, "bench and device outputs are all zero")
        if dmax <= zero:
            return CosineCheck(None, False, "device output is all zero, bench output is not")
        if bmax <= zero:
            return CosineCheck(None, False, "bench output is all zero, device output is not")
        cos = f["cos"]
        if math.isnan(cos):
            return CosineCheck(cos, False, "cosine similarity is NaN (inf or NaN in the outputs)")
        cos = min(1.0, max(-1.0, cos))
        return CosineCheck(cos, cos > COSINE_PASS, "")

    def metrics(self, numel: int) -> OutputMetrics:
        c, f = self._resolve()
        rel_max = f["max_rel"]
        return OutputMetrics(
            cosine=self.cosine(numel).value,
            max_abs_err=f["max_abs"],
            hundredth=c["hundredth"] / numel,
            thousandth=c["thousandth"] / numel,
            ten_thousandth=c["ten_thousandth"] / numel,
            binary_error_rate=c["binary"] / numel,
            error_balance=abs(c["above"] - c["below"]) / numel,
            rmse=math.sqrt(f["sum_sq"] / c["normal"]) if c["normal"] else 0.0,
            small_value_error_ratio=_ratio(c["small_bad"], c["small"], 0.0),
            max_rel_err=rel_max if rel_max >= 0 else 0.0,
            mean_rel_err=_ratio(f["sum_rel"], c["normal"], 0.0),
            inf_nan_error_rate=_ratio(c["inf_nan_bad"], c["inf_nan"], 0.0),
            rel_err_rate=_ratio(c["rel_bad"], c["normal"], 0.0),
            abs_err_rate=_ratio(c["small_bad"], c["small"], 0.0),
            ulp_max=f["max_ulp"],
            ulp_mean=f["sum_ulp"] / numel,
            ulp_over_threshold=c["ulp_over"] / numel,
            counts={"numel": numel, **{k: c[k] for k in ("small", "small_bad", "ulp_over", "hundredth", "thousandth",
                                                         "ten_thousandth", "inf_nan", "inf_nan_bad")}},
        )


# -- the finite fast path: one pass over a chunk in cache-sized tiles, into reused buffers ---------------------------
# Elements per tile on a CPU bench: every float64 temporary of a tile stays in the core's cache. The compiled pass
# writes 1 + 5 rows a tile for each output compared with the bench (two outputs: eleven rows, 704 KiB at 2^13) and
# torch sums them right after: at 2^15 (2.75 MiB) they no longer fit a 2 MiB L2, and bench/metric_throughput.py's two
# outputs took 5.4-5.8 ns per element and output against 4.1-4.4 at 2^13 (2^14: 4.7-4.9; 2^12: 5.6, the loop's own
# cost per tile then shows). The tiles' sums are added in order, so the tile is part of every path's bits.
_TILE = 1 << 13


def _tile_of(device: torch.device, n: int) -> int:
    """Elements per tile of a chunk of `n` on `device`: `_TILE` on a CPU, the whole chunk elsewhere."""
    return _TILE if device.type == "cpu" else max(1, n)


def _on(value: Any, device: torch.device) -> torch.Tensor:
    """A statistic kept as a number or a 0-dim tensor, as a float64 tensor on `device` (the same value)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return torch.tensor(value, dtype=torch.float64, device=device)


def _tiled_sum(values: torch.Tensor) -> torch.Tensor:
    """The float64 sum of a chunk's summands, as every path of the metrics takes it: torch's sum of each tile
    (`_tile_of`, from the chunk's start), the tiles' sums added in order (`_in_order`). The fast path sums each tile
    while it is in the cache, right after computing it; the general path (`_Accumulator.add`) sums its whole-chunk
    summands the same way, so that both give the same bits."""
    n = values.numel()
    tile = _tile_of(values.device, n)
    return _in_order([values[lo:lo + tile].sum() for lo in range(0, max(n, 1), tile)])


def _in_order(tile_sums: list[torch.Tensor]) -> torch.Tensor:
    """A chunk's sum from its tiles' sums: ((t0 + t1) + t2) + ..., the one order every path adds them in."""
    total = tile_sums[0]
    for value in tile_sums[1:]:
        total = total + value
    return total


class _Scratch:
    """Buffers of one thread, reused from output to output (no allocation, no page faults per metric)."""

    def __init__(self):
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


def _scratch() -> _Scratch:
    s = getattr(_local, "scratch", None)
    if s is None:
        s = _local.scratch = _Scratch()
    return s


_SUMS = ("sq", "rel", "ulp", "dot", "dd")


def _add_finite_chunk(flat_b: torch.Tensor, quick: list, bmax: torch.Tensor, start: int, stop: int) -> None:
    """`_Accumulator.add` of elements [start, stop) for outputs whose bench, device and bench-in-the-device-dtype
    values are all finite and below 2^900 (checked on the whole output by the caller): the same values, without the
    inf/nan terms (all zero there), the bench's own terms computed once for every output compared with it.

    The elementwise terms are computed tile by tile into reused tile-sized buffers (cache-sized on a CPU bench; the
    whole chunk on a GPU), by metric_kernel's compiled pass (`_compiled_tiles`) or by torch ops (`_torch_tiles`), and
    each tile's summands are summed while they are in the cache; the tiles' sums are added in order, as `_tiled_sum`
    adds the general path's. Counts and maxima are exact whatever the tiling, so each statistic is bit for bit what
    `_Accumulator.add` computes."""
    n, dev = stop - start, flat_b.device
    counts = [dict.fromkeys(("hundredth", "thousandth", "ten_thousandth", "small", "small_bad", "rel_bad",
                             "ulp_over"), 0) for _ in quick]
    signs = [[0, 0] for _ in quick]   # sums of sign(d - b) and of sign(|d - b|): above - below, above + below
    maxima: list[dict] = [{} for _ in quick]
    kern = _kernel_for(n) if dev.type == "cpu" else None
    tiles = (_compiled_tiles(kern, flat_b, quick, bmax, start, n, counts, signs, maxima) if kern is not None
             else _torch_tiles(flat_b, quick, bmax, start, n, counts, signs, maxima))
    bb_sums: list[torch.Tensor] = []
    per_tile: list[dict[str, list[torch.Tensor]]] = [{k: [] for k in _SUMS} for _ in quick]
    for bb_sum, sums in tiles:   # each tile's sums, in order
        bb_sums.append(bb_sum)
        for collected, tile_sums in zip(per_tile, sums):
            for key, value in tile_sums.items():
                collected[key].append(value)
    f64 = torch.float64
    for j, (acc, _) in enumerate(quick):
        c, mx = counts[j], maxima[j]
        net, moved = signs[j]
        if isinstance(net, int) and isinstance(moved, int):   # the compiled pass's counts
            above, below = (moved + net) // 2, (moved - net) // 2
        else:
            net, moved = (torch.as_tensor(v, dtype=f64, device=dev) for v in signs[j])
            above, below = ((moved + net) / 2).to(torch.int64), ((moved - net) / 2).to(torch.int64)
        acc.counts["binary"] = acc.counts["binary"] + above + below
        acc.counts["above"] = acc.counts["above"] + above
        acc.counts["below"] = acc.counts["below"] + below
        for key, value in c.items():
            acc.counts[key] = acc.counts[key] + value
        acc.counts["normal"] = acc.counts["normal"] + (n - c["small"])
        for key in _SUMS:
            acc.sums[key] = _plus(acc.sums[key], _in_order(per_tile[j][key]), dev)
        for key in ("abs", "rel", "ulp"):
            old, new = acc.maxima[key], mx[key]
            both = isinstance(old, float) and isinstance(new, float)   # (finite here: no NaN to propagate)
            acc.maxima[key] = max(old, new) if both else torch.maximum(_on(old, dev), _on(new, dev))
        acc.sums["bb"] = _plus(acc.sums["bb"], _in_order(bb_sums), dev)


def _plus(total: Any, value: Any, device: torch.device) -> Any:
    """total + value, each a number or a 0-dim tensor: numbers while both are (the same float64 addition)."""
    if isinstance(total, float) and isinstance(value, float):
        return total + value
    return _on(total, device) + value


def _torch_tiles(flat_b: torch.Tensor, quick: list, bmax: torch.Tensor, start: int, n: int, counts: list,
                 signs: list, maxima: list) -> Iterator[tuple[torch.Tensor, list[dict[str, torch.Tensor]]]]:
    """The tile loop of `_add_finite_chunk` as torch ops (any device): yields each tile's sum of the bench's
    (b / bmax)^2 and each output's sums of its summands. A tile where an output equals the bench skips its error
    terms: their summands are +0.0, and with equal maxima its cosine summands are the bench's."""
    dev = flat_b.device
    sc = _scratch()
    f64 = torch.float64
    acc0 = quick[0][0]
    p = acc0.p
    tile = _tile_of(dev, n)
    scale = 2.0 ** p.ulp_precision
    size = min(tile, n)
    b_t, absb, denom, normal_f, bn, bb = (sc.get(k, size, f64, dev) for k in ("b", "absb", "denom", "normalf", "bn",
                                                                             "bb"))
    d_t, diff, abs_err, rel, tmp = (sc.get(k, size, f64, dev) for k in ("d", "diff", "abserr", "rel", "tmp"))
    small, normal, mask = (sc.get(k, size, torch.bool, dev) for k in ("small", "normal", "mask"))
    bits, spacing = sc.get("bits", size, torch.int64, dev), sc.get("spacing", size, torch.int64, dev)
    sums = [{k: sc.get(f"{k}{j}", size, f64, dev) for k in _SUMS} for j in range(len(quick))]
    on_cpu = dev.type == "cpu"       # shortcuts that read a value back: only where that costs no device sync
    zero = torch.zeros((), dtype=f64, device=dev)
    # an output equal to the bench has d / dmax == b / bmax element by element when the two maxima are equal
    same_norm = [on_cpu and bool(acc.dmax == bmax) for acc, _ in quick]
    for lo in range(0, n, tile):
        hi = min(n, lo + tile)
        m = hi - lo
        src = flat_b[start + lo:start + hi]
        b = src if src.dtype == f64 else b_t[:m].copy_(src)
        ab, den, sm, nm, nf, bnt = absb[:m], denom[:m], small[:m], normal[:m], normal_f[:m], bn[:m]
        torch.abs(b, out=ab)
        torch.gt(ab, p.small_value, out=nm)
        small_count = m - torch.count_nonzero(nm)
        any_small = not on_cpu or bool(small_count)
        torch.div(b, bmax, out=bnt)
        bb_sum = torch.square(bnt, out=bb[:m]).sum()
        error_terms = False   # the bench's terms of the error metrics: computed once an output differs here
        tile_sums: list[dict[str, torch.Tensor]] = []
        for j, (acc, flat_d) in enumerate(quick):
            c, mx, sj = counts[j], maxima[j], {k: v[:m] for k, v in sums[j].items()}
            d = d_t[:m].copy_(flat_d[start + lo:start + hi])
            c["small"] = c["small"] + small_count
            df, ae = diff[:m], abs_err[:m]
            torch.sub(d, b, out=df)            # finite: d > b <=> diff > 0, d != b <=> diff != 0 (no NaN)
            torch.abs(df, out=ae)
            tile_abs = ae.amax()
            mx["abs"] = tile_abs if "abs" not in mx else torch.maximum(mx["abs"], tile_abs)
            if on_cpu and not tile_abs:
                # the device output equals the bench here (an exact op: copies, relu, transpose ...): every error
                # term is zero; the values the general path computes, without computing them
                for key in ("hundredth", "thousandth", "ten_thousandth"):
                    c[key] = c[key] + m
                for key in ("rel", "ulp"):
                    _tile_max(mx, key, zero)
                if same_norm[j]:   # bn * bn is bn.square() bit for bit: the bench's own sum
                    tile_sums.append({"sq": zero, "rel": zero, "ulp": zero, "dot": bb_sum, "dd": bb_sum})
                else:
                    dn = torch.div(d, acc.dmax, out=tmp[:m])
                    tile_sums.append({"sq": zero, "rel": zero, "ulp": zero,
                                      "dot": torch.mul(bnt, dn, out=sj["dot"]).sum(),
                                      "dd": torch.square(dn, out=sj["dd"]).sum()})
                continue
            if not error_terms:
                error_terms = True
                torch.add(ab, acc0.eps, out=den)
                nf.copy_(nm)
                if any_small:
                    torch.logical_not(nm, out=sm)
                # exp2(-eb), eb = max(floor(log2|b|), min_eb), from the bits: the biased exponent of a float64 is
                # floor(log2|b|) + 1023 for normal numbers; zero and subnormals read -1023 and are clamped to
                # min_eb (>= -1022) like frexp's; 2^-eb for -1022 <= eb <= 900 is the float64 with biased exponent
                # 1023 - eb
                eb = bits[:m]
                torch.bitwise_right_shift(b.view(torch.int64), 52, out=eb)
                eb.bitwise_and_(0x7FF).sub_(1023).clamp_min_(p.ulp_min_exponent)
                torch.sub(1023, eb, out=spacing[:m])   # rsub
                spacing[:m].bitwise_left_shift_(52)
            spf = spacing[:m].view(f64)
            rl, tm, mk = rel[:m], tmp[:m], mask[:m]
            torch.div(ae, den, out=rl)
            for key, bound in (("hundredth", HUNDREDTH), ("thousandth", THOUSANDTH),
                               ("ten_thousandth", TEN_THOUSANDTH)):
                c[key] = c[key] + torch.count_nonzero(torch.lt(rl, bound, out=mk))
            sg = signs[j]
            sg[0] = sg[0] + torch.sign(df, out=tm).sum()   # sums of +-1 and 0: exact integers in float64
            sg[1] = sg[1] + torch.sign(ae, out=tm).sum()
            if any_small:
                c["small_bad"] = c["small_bad"] + torch.count_nonzero(
                    torch.gt(ae, p.small_atol, out=mk).logical_and_(sm))
            # abs_err and rel are finite below 2^900: times a 0/1 mask they are `where(normal, x, 0.0)` exactly;
            # the max of the masked rel differs from `add`'s (-1 for no normal element) only where `metrics` reads
            # 0 anyway; rtol > 0, so `normal & (rel > rtol)` is `rel * normal > rtol`
            torch.mul(ae, nf, out=tm)
            torch.square(tm, out=sj["sq"])
            rel_normal = torch.mul(rl, nf, out=sj["rel"])
            _tile_max(mx, "rel", rel_normal)
            c["rel_bad"] = c["rel_bad"] + torch.count_nonzero(torch.gt(rel_normal, p.rtol, out=mk))
            torch.mul(ae, spf, out=tm)
            ulp = torch.mul(tm, scale, out=sj["ulp"])
            _tile_max(mx, "ulp", ulp)
            c["ulp_over"] = c["ulp_over"] + torch.count_nonzero(torch.gt(ulp, p.ulp_threshold, out=mk))
            dn = torch.div(d, acc.dmax, out=tm)
            torch.mul(bnt, dn, out=sj["dot"])
            torch.square(dn, out=sj["dd"])
            tile_sums.append({k: v.sum() for k, v in sj.items()})
        yield bb_sum, tile_sums


# Outputs from this size on take the compiled pass when numba is installed. Smaller ones take it once it is loaded
# (by a larger output, or after SMALL_BEFORE_LOADING smaller ones: a process that checks that many is not a short
# one), else the torch ops: loading it costs about 0.2 s and its first call for each device dtype 0.2 s more, which
# a short-lived process with a few small outputs would not win back; a small output's torch ops cost 150-370 us
# more than the compiled pass (256-8192 elements; the same bits either way).
KERNEL_MIN_ELEMENTS = 1 << 14
SMALL_BEFORE_LOADING = 256
USE_KERNEL = True   # False: the torch ops for every output (tests, bench/metric_throughput.py)
_small_seen = itertools.count()


def _kernel_for(n: int):
    """The compiled pass for a CPU chunk of n elements, or None for the torch ops (the rule above)."""
    if not USE_KERNEL:
        return None
    if n >= KERNEL_MIN_ELEMENTS or next(_small_seen) >= SMALL_BEFORE_LOADING:
        return metric_kernel.kernel()
    return metric_kernel.loaded()


def _compiled_tiles(kern, flat_b: torch.Tensor, quick: list, bmax: torch.Tensor, start: int, n: int, counts: list,
                    signs: list, maxima: list) -> Iterator[tuple[torch.Tensor, list[dict[str, torch.Tensor]]]]:
    """The tile loop of `_add_finite_chunk` with metric_kernel's one-pass terms, one kernel call per tile and output:
    yields the tile's sums as `_torch_tiles` does (every summand written, no exact-tile shortcuts needed), and
    leaves counts, signs and maxima as the torch loop leaves them. Bench values other than contiguous float64, and
    device values other than contiguous float32 or float64, are first copied into a float64 tile, as the torch loop
    does."""
    f64, dev = torch.float64, flat_b.device
    sc = _scratch()
    acc0 = quick[0][0]
    p = acc0.p
    size = min(_TILE, n)
    spb, ae = sc.get("spacing", size, torch.int64, dev), sc.get("abserr", size, f64, dev)
    np_spb = spb.numpy()
    np_spf, np_ae = np_spb.view(numpy.float64), ae.numpy()
    bounds = numpy.array([HUNDREDTH, THOUSANDTH, TEN_THOUSANDTH], dtype=numpy.float64)
    scale = 2.0 ** p.ulp_precision
    bmax_f = float(bmax)
    dmax_f = [float(acc.dmax) for acc, _ in quick]
    # every summand of the tile in one buffer, a row each: the bench's (b / bmax)^2, then each output's _SUMS; the
    # rows are summed by one torch sum over the last dimension, each row as torch sums it alone (the same bits:
    # tests/test_fast_paths.py), in one call and one transfer instead of one sum per row
    k = len(_SUMS)
    grid = sc.get(f"grid{len(quick)}", (1 + k * len(quick)) * size, f64, dev).view(1 + k * len(quick), size)
    np_grid = grid.numpy()
    np_bb = np_grid[0]
    np_sums = [dict(zip(_SUMS, np_grid[1 + k * j:1 + k * (j + 1)])) for j in range(len(quick))]
    src = flat_b[start:start + n]
    b_all = src.numpy() if src.dtype == f64 and src.is_contiguous() else None   # else copied tile by tile
    d_srcs = [flat_d[start:start + n] for _, flat_d in quick]
    d_alls = [d.numpy() if d.dtype in _KERNEL_DTYPES and d.is_contiguous() else None for d in d_srcs]
    tally = [numpy.zeros(len(metric_kernel.COUNT_KEYS), dtype=numpy.int64) for _ in quick]
    top = [numpy.zeros(len(metric_kernel.MAX_KEYS), dtype=numpy.float64) for _ in quick]   # every term >= +0.0
    consts = (np_spb, np_spf, np_ae, size)
    params = (acc0.eps, p.small_value, p.small_atol, p.rtol, scale, p.ulp_min_exponent, p.ulp_threshold, bounds)

    def rows(m: int) -> tuple:
        """The kernel's output rows of a tile of m elements, per output (the same views for every full tile)."""
        return tuple((np_bb[:m], j == 0, *(np_sums[j][key][:m] for key in _SUMS), tally[j], top[j])
                     for j in range(len(quick)))

    full = rows(size)
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        m = hi - lo
        out, sums = (full, grid) if m == size else (rows(m), grid[:, :m])
        b = b_all[lo:hi] if b_all is not None else sc.get("b", size, f64, dev)[:m].copy_(src[lo:hi]).numpy()
        bits = b.view(numpy.int64)
        for j, d_all in enumerate(d_alls):
            d = d_all[lo:hi] if d_all is not None else sc.get("d", size, f64, dev)[:m].copy_(d_srcs[j][lo:hi]).numpy()
            kern(b, bits, d, *consts, bmax_f, dmax_f[j], *params, *out[j])
        # the tile's sums (torch's) as numbers: added as numbers from here on
        values = sums.sum(1).tolist()
        yield values[0], [dict(zip(_SUMS, values[1 + k * j:1 + k * (j + 1)])) for j in range(len(quick))]
    for j in range(len(quick)):
        got = dict(zip(metric_kernel.COUNT_KEYS, tally[j].tolist()))
        above, below = got.pop("above"), got.pop("below")
        signs[j] = [above - below, above + below]
        for key, value in got.items():
            counts[j][key] = counts[j][key] + value
        for key, value in zip(metric_kernel.MAX_KEYS, top[j].tolist()):
            maxima[j][key] = value


_KERNEL_DTYPES = (torch.float32, torch.float64)   # device values the kernel reads as they are


def _tile_max(maxima: dict, key: str, values: torch.Tensor) -> None:
    m = values.amax()
    old = maxima.get(key)
    maxima[key] = m if old is None else torch.maximum(old, m)
