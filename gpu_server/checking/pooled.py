"""Judging across calls: the device's error pooled over every call of an API in the run (docs/pooled.md).

Each row judges one call, so a bias below one unit in the last place passes every call. `PooledErrors` pools, per
(API, direction, device dtype), the error of every compared float element against the bench in ULP of the device
dtype at the bench value, e = (x - bench) / ulp(bench), clipped at +-CLIP_ULP, for the device (e_d) and the host's
same-dtype run (e_s), and tests three statistics of the PAIRED difference p = e_d - e_s (the same-dtype run is a
correct implementation that sees the same inputs and rounds the same outputs: pairing removes the rounding noise
both share, which is what makes 1 % of the elements one ULP up visible in a few thousand elements):

- bias: the mean of p (two-sided): a one-sided signed bias;
- magnitude: the mean of p * sign(bench) (two-sided): a scale or a truncation toward zero, which cancels in the
  signed mean on data of both signs;
- spread: the mean of e_d^2 - R * e_s^2 (one-sided, R = `spread_tolerance` = 4, the benchmark standard's RMSE
  ratio limit of 2 squared): a device noisier than a correct implementation.

Each statistic gives z = mean / standard error and a p value from the normal tail; the tests of the run are corrected
together (Holm's step-down, never stricter than Bonferroni) so that the probability of ANY false finding in the run
is at most `false_alarm_rate` (1e-6), which bounds every API's per-run false-alarm rate too. Only tests that could
reject count: three per (API, direction, dtype) whose device output differs from the same-dtype run somewhere.

Assumption: the errors of different elements are roughly independent. Guards where they are not: the variance of
the sum is the largest of the element-level estimate and the batch-means estimates over groups of whole rows of the
last dimension (ROW_BLOCK: a correct device's row-wise error in a normalisation or softmax), over BLOCKS of
consecutive elements (once the run has MIN_BLOCKS of them) and over outputs (once there are MIN_OUTPUTS); and |z|
is at most the uncentred self-normalised sum |sum x| / sqrt(sum x^2), so k elements that differ by the same amount
never weigh more than sqrt(k) standard errors (a finding needs at least z^2 differing elements). A significant bias
that is the same-dtype run's own (the device no further from the bench than that run, which is itself significantly
biased: HOST_Z) is a pass with a note.

Cost: about sixty vectorised torch ops per observed output on the tensors already in memory, in the bench dtype on
the bench's device, one synchronisation (0.5 ms for a small output on one CPU core; on a CPU with numba the thirty
elementwise ones are one compiled pass, gpu_server/checking/pooled_kernel.py); an output of more than
`max_elements` (MAX_ELEMENTS) elements is subsampled with a fixed stride (every k-th element in row-major order), so
that no output costs more than about 2.5 ms.
"""
from __future__ import annotations

import csv
import io
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import torch

from gpu_server.atomic_file import write_atomic
from gpu_server.checking import pooled_kernel
from gpu_server.judging import metric_kernel
from gpu_server.reports import files as report_files
from gpu_server.reports.rank_reports import _BOM, clean

FALSE_ALARM_RATE = 1e-6        # per run: any false finding at all, hence per API per run too
# Above this pooled bias (ULP of the device dtype) a significant bias is an `error`, below it a `finding`. A
# bfloat16 matmul whose float32 accumulator truncates while aligning the addends (by design on some matrix units)
# shows a magnitude bias of about -0.001 ULP at its output (docs/pooled.md); 0.005 leaves it a finding while 1 % of
# the elements one ULP off (0.01 ULP, a kernel bug: elementwise ops round correctly) is an error.
DEFAULT_FAIL_ABOVE_ULP = 0.005
SPREAD_TOLERANCE = 4.0         # device MSE / same-dtype MSE accepted (RMSE ratio 2, the benchmark standard's)
CLIP_ULP = 16.0                # per-element errors winsorized here: near cancellation the ULP at the bench is tiny
MAX_ELEMENTS = 1 << 14         # per output; larger outputs are subsampled with a fixed stride
ROW_BLOCK = 32                 # batch means over groups of whole rows (last dimension) of at least this many elements
BLOCKS = (256, 4096)           # ... and over blocks of these many consecutive elements,
MIN_BLOCKS = 64                # each used once the pool holds this many of its blocks
MIN_OUTPUTS = 8                # observed outputs needed before the between-output variance is used
HOST_Z = 3.0                   # the same-dtype run's own bias this significant (and not smaller than the device's):
                               # a significant paired bias is the host run's, not the device's

_MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}
_BENCH = (torch.float32, torch.float64)
STATISTICS = ("bias", "magnitude", "spread")
VERDICTS = ("pass", "finding", "error")

# CSV columns of api_bias_{ts}.csv, in order (docs/pooled.md explains each); also the keys of each as_dict() row
COLUMNS = ("api", "direction", "dtype", "calls", "outputs", "elements", "elements_seen", "differing_elements",
           "bias_ulp", "magnitude_bias_ulp", "device_bias_ulp", "same_bias_ulp", "device_magnitude_bias_ulp",
           "same_magnitude_bias_ulp", "spread_ratio", "z_bias", "z_magnitude", "z_spread", "z_same_bias",
           "z_same_magnitude", "p_bias", "p_magnitude", "p_spread", "z_threshold", "detectable_ulp", "verdict",
           "reason")

_TEXT = ("api", "direction", "dtype", "verdict", "reason")

# Element sums kept per (api, direction, dtype), in this order (float64, exact enough: each term is bounded).
_N, _P, _P2, _Q, _ED, _ES, _EDS, _ESS, _A, _C, _W, _W2, _NZ = range(13)
_NSUMS = 13
# Per scale of grouping (rows, each of BLOCKS, outputs): for each grouped quantity x (p, q, w and the same-dtype
# run's own e_s, e_s * sign) the sum over groups of S_j^2, then of n_j * S_j (S_j the group's sum of x, n_j its
# elements), then the sum of n_j^2, then the number of groups.
_GP, _GQ, _GW, _GES, _GESS = range(5)
_K = 5
_NSCALE = 2 * _K + 2
_SCALES = 2 + len(BLOCKS)
_ROWS, _OUTPUTS = 0, _SCALES - 1


@dataclass
class _Acc:
    sums: list[float] = field(default_factory=lambda: [0.0] * _NSUMS)
    scales: list[list[float]] = field(default_factory=lambda: [[0.0] * _NSCALE for _ in range(_SCALES)])
    outputs: int = 0
    elements_seen: int = 0
    per_index: Counter = field(default_factory=Counter)

    def copy(self) -> "_Acc":
        return _Acc(list(self.sums), [list(x) for x in self.scales], self.outputs, self.elements_seen,
                    Counter(self.per_index))


def _normal_two_sided(z: float) -> float:
    return math.erfc(abs(z) / math.sqrt(2.0))


def _normal_upper(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def z_threshold(alpha: float, tests: int, two_sided: bool = True) -> float:
    """The Bonferroni z a single test needs among `tests` at family-wise level `alpha`."""
    tail = alpha / max(1, tests) / (2.0 if two_sided else 1.0)
    return -NormalDist().inv_cdf(tail)


def _tests(informative_groups: int) -> int:
    """Tests that could reject: three per (api, direction, dtype) whose device output differs somewhere from the
    same-dtype run (at least 1, for the thresholds)."""
    return max(1, len(STATISTICS) * informative_groups)


def _usable(bench: Any, device: Any, same: Any) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (bench, device, same)):
        return False
    if device.dtype not in _MANTISSA or same.dtype != device.dtype or bench.dtype not in _BENCH:
        return False
    if torch.finfo(bench.dtype).eps >= torch.finfo(device.dtype).eps:
        return False   # a bench no wider than the device carries no information below one ULP
    return device.numel() > 0 and bench.shape == device.shape == same.shape


def _group_sums(g: torch.Tensor) -> torch.Tensor:
    """From per-group sums g (K + 1, groups: the element count, then the K quantities) the 2K + 1 sums of a scale:
    sum S_j^2 (K), sum n_j S_j (K), sum n_j^2."""
    nj, sj = g[0], g[1:]
    return torch.cat([(sj * sj).sum(dim=1), (sj * nj).sum(dim=1), (nj * nj).sum().reshape(1)])


def _groups(buf: torch.Tensor, length: int) -> torch.Tensor:
    """Per-group sums of buf (K + 1, n) over consecutive groups of `length` columns (the last one partial), summed
    in buf's dtype (torch's cascade summation) and returned in float64."""
    n = buf.shape[1]
    full = n // length
    parts = []
    if full:
        parts.append(buf[:, :full * length].reshape(buf.shape[0], full, length).sum(dim=2))
    if n > full * length:
        parts.append(buf[:, full * length:].sum(dim=1, keepdim=True))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).double()


def _coarser(g: torch.Tensor, factor: int) -> torch.Tensor:
    """Group sums over `factor` consecutive groups of g (the last one partial)."""
    if factor <= 1:
        return g
    full = g.shape[1] // factor
    parts = [g[:, :full * factor].reshape(g.shape[0], full, factor).sum(dim=2)] if full else []
    if g.shape[1] > full * factor:
        parts.append(g[:, full * factor:].sum(dim=1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _terms(bench: torch.Tensor, device: torch.Tensor, same: torch.Tensor, clip: float, tolerance: float,
           max_elements: int) -> tuple[list[float], list[list[float]]]:
    """(element sums, [the grouped sums and the group count of each scale]) of one output, one synchronisation.

    Computed in the bench dtype (float32 for 16-bit devices, float64 for float32), sums in float64:
    e = (x * 2^-E - m) * 2^(P + 1) with bench = m * 2^E (frexp, 0.5 <= |m| < 1) and P the device dtype's mantissa
    bits, exact (power-of-two scalings of values within a factor 2 of the bench)."""
    numel = device.numel()
    stride = -(-numel // max_elements)
    b = bench.detach().reshape(-1)[::stride]
    wd = b.dtype
    d = device.detach().reshape(-1)[::stride].to(device=b.device, dtype=wd)
    s = same.detach().reshape(-1)[::stride].to(device=b.device, dtype=wd)
    n = b.numel()
    fi = torch.finfo(device.dtype)
    k = float(2 ** (_MANTISSA[device.dtype] + 1))
    buf = torch.empty((1 + _K, n), dtype=wd, device=b.device)   # rows: mask, p, q, w, e_s, e_s * sign
    extra = torch.empty((4, n), dtype=wd, device=b.device)      # rows: e_d^2, e_s^2, p^2, w^2
    kern = _kernel() if b.device.type == "cpu" else None
    if kern is not None:
        consts = torch.tensor([fi.tiny, fi.max, k, clip, tolerance, 1.0], dtype=wd)
        nz = kern(b.contiguous().numpy(), d.contiguous().numpy(), s.contiguous().numpy(), consts.numpy(),
                  torch.empty(1, dtype=wd).numpy(), buf.numpy(), extra.numpy())
        nonzero = torch.tensor(float(nz), dtype=wd)
    else:
        nonzero = _elementwise(b, d, s, fi, k, clip, tolerance, buf, extra)
    a, c, pp, ww = extra
    # whole rows of the last dimension, at least ROW_BLOCK elements (a normalisation's or softmax's row-wise error
    # of a correct device stays inside one group); fixed blocks of BLOCKS elements (in the subsampled order)
    row = device.shape[-1] if device.dim() else 1
    row_len = max(1, round(row * max(1, -(-ROW_BLOCK // max(1, row))) / stride))
    g_rows = _groups(buf, row_len)
    squares = torch.stack([pp.sum(), a.sum(), c.sum(), ww.sum(), nonzero]).double()
    sums = torch.cat([g_rows.sum(dim=1), squares])     # n, sum p, q, w, e_s, e_s * sign; sum p^2, a, c, w^2; nz
    parts, counts = [sums, _group_sums(g_rows)], [g_rows.shape[1]]
    g = g_rows if BLOCKS[0] % row_len == 0 else _groups(buf, BLOCKS[0])
    g = _coarser(g, BLOCKS[0] // row_len if BLOCKS[0] % row_len == 0 else 1)
    for i, length in enumerate(BLOCKS):
        if i:
            g = _coarser(g, length // BLOCKS[i - 1])
        parts.append(_group_sums(g))
        counts.append(g.shape[1])
    out = torch.cat(parts).tolist()
    (cnt, sp, sq, sw, ses, sess), (sp2, sa, sc, sw2, nz) = out[:1 + _K], out[1 + _K:_K + 6]
    el = [0.0] * _NSUMS
    el[_N], el[_P], el[_P2], el[_Q], el[_ES], el[_ESS] = cnt, sp, sp2, sq, ses, sess
    el[_ED], el[_EDS] = sp + ses, sq + sess        # e_d = p + e_s
    el[_A], el[_C], el[_W], el[_W2], el[_NZ] = sa, sc, sw, sw2, nz
    width, at = 2 * _K + 1, _K + 6
    scales = [out[at + width * j:at + width * (j + 1)] + [float(counts[j])] for j in range(len(counts))]
    whole = [sp, sq, sw, ses, sess]
    scales.append([v * v for v in whole] + [cnt * v for v in whole] + [cnt * cnt, 1.0])
    return el, scales


def _elementwise(b: torch.Tensor, d: torch.Tensor, s: torch.Tensor, fi: Any, k: float, clip: float,
                 tolerance: float, buf: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """The elementwise terms of `_terms` as torch ops (any device; gpu_server/checking/pooled_kernel.py computes the
    same on a CPU in one pass): fills buf's and extra's rows, returns the count of non-zero p (a 0-dim tensor)."""
    wd = b.dtype
    mag = b.abs()
    ok = (mag >= fi.tiny) & (mag <= fi.max) & torch.isfinite(d) & torch.isfinite(s)
    one = torch.ones((), dtype=wd, device=b.device)
    b, d, s = torch.where(ok, b, one), torch.where(ok, d, one), torch.where(ok, s, one)   # e = 0 where not ok
    mant, exp = torch.frexp(b)
    scale = torch.exp2(exp.to(wd).neg_())       # 2^-E: x * 2^-E is within a factor 2 of m, exact (no overflow)
    m, p, q, w, e_s, e_ss = buf
    a, c, pp, ww = extra
    m.copy_(ok)
    e_d = torch.mul(d, scale).sub_(mant).mul_(k).clamp_(-clip, clip)   # a gross error saturates at +-clip
    torch.mul(s, scale, out=e_s).sub_(mant).mul_(k).clamp_(-clip, clip)
    sign = mant.sign_()
    torch.sub(e_d, e_s, out=p)
    torch.mul(p, sign, out=q)
    torch.mul(e_s, sign, out=e_ss)
    torch.mul(e_d, e_d, out=a)
    torch.mul(e_s, e_s, out=c)
    torch.sub(a, torch.mul(c, tolerance, out=w), out=w)   # two roundings, as the compiled pass (alpha= fuses them)
    torch.mul(p, p, out=pp)
    torch.mul(w, w, out=ww)
    return torch.count_nonzero(p).to(wd)


def _kernel():
    """The compiled elementwise pass for a CPU output, when the metrics' compiled pass is loaded (the same rule:
    gpu_server/judging/metrics.py's `_kernel_for`), else None: the torch ops."""
    if not USE_KERNEL or metric_kernel.loaded() is None:
        return None
    return pooled_kernel.kernel()


USE_KERNEL = True   # False: the torch ops on a CPU too (tests)


def _var_of_sum(sum_x: float, sum_x2: float, n: float, mean: float, grouped: list[tuple[float, float, float]]) -> float:
    """The variance of sum(x) over n elements: the largest of the element-level estimate and each grouped estimate
    (sum_j (S_j - n_j * mean)^2 from sum S_j^2, sum n_j S_j, sum n_j^2)."""
    var = max(0.0, sum_x2 - n * mean * mean)
    for s2, ns, n2 in grouped:
        var = max(var, s2 - 2.0 * mean * ns + mean * mean * n2)
    return var


def _z(sum_x: float, sum_x2: float, n: float, grouped: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(z, standard error of the mean): mean / se, at most the uncentred self-normalised sum in size."""
    if n <= 0 or sum_x2 <= 0.0:
        return 0.0, 0.0
    mean = sum_x / n
    var = _var_of_sum(sum_x, sum_x2, n, mean, grouped)
    se = math.sqrt(var) / n
    bound = sum_x / math.sqrt(sum_x2)
    z = bound if se == 0.0 else math.copysign(min(abs(mean / se), abs(bound)), mean)
    return z, se


def _round(x: float | None, digits: int = 6) -> float | None:
    """For JSON: 6 significant digits; inf and NaN (a spread ratio over a same-dtype run without error) as None."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


class PooledErrors:
    """Thread-safe accumulator of the pooled statistics of a run; see the module docstring and docs/pooled.md."""

    def __init__(self, fail_above_ulp: float = DEFAULT_FAIL_ABOVE_ULP, false_alarm_rate: float = FALSE_ALARM_RATE,
                 spread_tolerance: float = SPREAD_TOLERANCE, clip_ulp: float = CLIP_ULP,
                 max_elements: int = MAX_ELEMENTS):
        if not fail_above_ulp >= 0 or not 0 < false_alarm_rate < 1 or not spread_tolerance >= 1 or not clip_ulp > 0:
            raise ValueError("fail_above_ulp >= 0, 0 < false_alarm_rate < 1, spread_tolerance >= 1 and clip_ulp > 0 "
                             "are needed")
        self.fail_above_ulp = float(fail_above_ulp)
        self.false_alarm_rate = float(false_alarm_rate)
        self.spread_tolerance = float(spread_tolerance)
        self.clip_ulp = float(clip_ulp)
        self.max_elements = max(1, int(max_elements))
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, str, str], _Acc] = {}

    # -- accumulating ------------------------------------------------------------------------------------------
    def observe(self, api: str, direction: str, bench: Any, device: Any, same: Any, *, output_index: int = 0) -> None:
        """Pool one compared output (bench in the bench dtype; device and same in the device dtype). Anything but
        a float16/bfloat16/float32 output of the same shape on all three sides, not empty, with a wider bench, is
        ignored; so are elements not finite on every side or whose bench is outside the device dtype's normal
        range. `output_index` (the output's position in the call) only serves to count calls."""
        if not _usable(bench, device, same):
            return
        with torch.no_grad():
            el, scales = _terms(bench, device, same, self.clip_ulp, self.spread_tolerance, self.max_elements)
        if el[_N] <= 0:
            return
        key = (str(api), str(direction), str(device.dtype).replace("torch.", ""))
        with self._lock:
            acc = self._groups.get(key)
            if acc is None:
                acc = self._groups[key] = _Acc()
            for i, v in enumerate(el):
                acc.sums[i] += v
            for k, values in enumerate(scales):
                for i, v in enumerate(values):
                    acc.scales[k][i] += v
            acc.outputs += 1
            acc.elements_seen += device.numel()
            acc.per_index[int(output_index)] += 1

    # -- judging -------------------------------------------------------------------------------------------------
    def _row(self, key: tuple[str, str, str], acc: _Acc) -> dict:
        s = acc.sums
        n = s[_N]
        used = [acc.scales[_ROWS]] + [g for g in acc.scales[1:_OUTPUTS] if g[-1] >= MIN_BLOCKS]
        if acc.outputs >= MIN_OUTPUTS:
            used.append(acc.scales[_OUTPUTS])
        grouped = [[(g[k], g[_K + k], g[2 * _K]) for g in used if g[-1] >= 2] for k in range(_K)]
        z_b, se_b = _z(s[_P], s[_P2], n, grouped[_GP])
        z_m, se_m = _z(s[_Q], s[_P2], n, grouped[_GQ])
        z_s, _ = _z(s[_W], s[_W2], n, grouped[_GW])
        # the same-dtype run's own bias against the bench (is the host's run the biased one? see rows())
        z_hb, _ = _z(s[_ES], s[_C], n, grouped[_GES])
        z_hm, _ = _z(s[_ESS], s[_C], n, grouped[_GESS])
        informative = s[_NZ] > 0
        a, c = s[_A], s[_C]
        spread = a / c if c > 0 else (1.0 if a == 0 else math.inf)
        return {
            "api": key[0], "direction": key[1], "dtype": key[2],
            "calls": max(acc.per_index.values()) if acc.per_index else 0, "outputs": acc.outputs,
            "elements": int(n), "elements_seen": acc.elements_seen, "differing_elements": int(s[_NZ]),
            "bias_ulp": s[_P] / n, "magnitude_bias_ulp": s[_Q] / n,
            "device_bias_ulp": s[_ED] / n, "same_bias_ulp": s[_ES] / n,
            "device_magnitude_bias_ulp": s[_EDS] / n, "same_magnitude_bias_ulp": s[_ESS] / n,
            "spread_ratio": spread, "z_bias": z_b, "z_magnitude": z_m, "z_spread": z_s,
            "z_same_bias": z_hb, "z_same_magnitude": z_hm,
            "p_bias": _normal_two_sided(z_b) if informative else 1.0,
            "p_magnitude": _normal_two_sided(z_m) if informative else 1.0,
            "p_spread": _normal_upper(z_s) if informative else 1.0,
            "_se": max(se_b, se_m), "_informative": informative,
        }

    def rows(self) -> list[dict]:
        """One row per (api, direction, dtype) with its statistics and verdict (keys: COLUMNS), sorted by API."""
        with self._lock:
            items = [(k, a.copy()) for k, a in self._groups.items()]
        rows = [self._row(k, a) for k, a in sorted(items)]
        tests = _tests(sum(1 for r in rows if r["_informative"]))
        alpha = self.false_alarm_rate
        # Holm's step-down over every informative test of the run: the k-th smallest p value (0-based) is
        # significant while p <= alpha / (tests - k)
        pvals = sorted((r[f"p_{stat}"], i, stat) for i, r in enumerate(rows) if r["_informative"]
                       for stat in STATISTICS)
        significant: dict[int, list[str]] = {}
        for k, (pv, i, stat) in enumerate(pvals):
            if pv > alpha / (tests - k):
                break
            significant.setdefault(i, []).append(stat)
        zt = z_threshold(alpha, tests)
        for i, r in enumerate(rows):
            n = r["elements"]
            se = r.pop("_se")
            r.pop("_informative")
            r["z_threshold"] = zt
            # the smallest mean bias found at the Bonferroni level: z * se, and never below z^2 / n (at least z^2
            # elements must differ by one ULP)
            r["detectable_ulp"] = max(zt * se, zt * zt / n) if n else math.inf
            stats = significant.get(i, [])
            host = [st for st in stats if st != "spread" and self._host_biased(r, st)]
            stats = [st for st in stats if st not in host]
            biased = [st for st in stats if st != "spread"]
            size = max((abs(r["bias_ulp" if st == "bias" else "magnitude_bias_ulp"]) for st in biased), default=0.0)
            if biased and size > self.fail_above_ulp:
                r["verdict"] = "error"
            elif stats:
                r["verdict"] = "finding"
            else:
                r["verdict"] = "pass"
            r["reason"] = self._reason(r, stats, size, host)
        return rows

    @staticmethod
    def _host_biased(r: dict, stat: str) -> bool:
        """A significant bias against the same-dtype run that is the RUN's: the device is no further from the bench
        than the host's same-dtype run, which is itself significantly biased against the bench (a float32 host
        kernel's own approximation, e.g. CPU gelu: +0.4 ULP). Never a finding of the device."""
        suffix = "bias_ulp" if stat == "bias" else "magnitude_bias_ulp"
        z_host = r["z_same_bias" if stat == "bias" else "z_same_magnitude"]
        return abs(r[f"device_{suffix}"]) <= abs(r[f"same_{suffix}"]) and abs(z_host) >= HOST_Z

    def _reason(self, r: dict, stats: list[str], size: float, host: list[str] = ()) -> str:
        notes = [f"the same-dtype run, not the device, is biased against the bench "
                 f"({'signed' if st == 'bias' else 'in magnitude'}: same-dtype run "
                 f"{r['same_bias_ulp' if st == 'bias' else 'same_magnitude_bias_ulp']:+.3g} ULP, z "
                 f"{r['z_same_bias' if st == 'bias' else 'z_same_magnitude']:+.1f}; device "
                 f"{r['device_bias_ulp' if st == 'bias' else 'device_magnitude_bias_ulp']:+.3g} ULP)" for st in host]
        if not stats:
            return "; ".join(notes)
        parts = []
        if "bias" in stats:
            parts.append(f"signed bias {r['bias_ulp']:+.3g} ULP against the same-dtype run (z {r['z_bias']:+.1f})")
        if "magnitude" in stats:
            parts.append(f"bias in magnitude {r['magnitude_bias_ulp']:+.3g} ULP (z {r['z_magnitude']:+.1f})")
        if "spread" in stats:
            parts.append(f"spread {r['spread_ratio']:.3g}x the same-dtype run's mean-square error, above "
                         f"{self.spread_tolerance:g}x (z {r['z_spread']:+.1f})")
        limit = (f"; {size:.3g} ULP {'>' if size > self.fail_above_ulp else '<='} the limit {self.fail_above_ulp:g}"
                 if size else "")
        return "; ".join(parts) + limit + "".join(f"; {n}" for n in notes)

    def findings(self) -> list[dict]:
        return [r for r in self.rows() if r["verdict"] != "pass"]

    def as_dict(self) -> dict:
        """JSON-serialisable: the run's settings, its tests and every row, the findings (verdict != pass) apart."""
        rows = [{k: (_round(v) if isinstance(v, float) else v) for k, v in r.items()} for r in self.rows()]
        tests = _tests(sum(1 for r in rows if r["differing_elements"] > 0))
        return {"false_alarm_rate_per_api": self.false_alarm_rate, "fail_above_ulp": self.fail_above_ulp,
                "spread_tolerance": self.spread_tolerance, "clip_ulp": self.clip_ulp, "tests": tests,
                "apis": rows, "findings": [r for r in rows if r["verdict"] != "pass"]}

    # -- the CSV -------------------------------------------------------------------------------------------------
    def write_csv(self, out_dir: str, ts: str) -> str:
        """`api_bias_{ts}.csv` in out_dir (UTF-8 with BOM, one row per (api, direction, dtype)), written atomically;
        returns its path."""
        path = report_files.api_bias_path(out_dir, ts)
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(COLUMNS)
        for r in self.rows():
            writer.writerow([clean(r[c]) if c in _TEXT else _cell(r[c]) for c in COLUMNS])
        data = _BOM + buf.getvalue().encode("utf-8")
        write_atomic(path, lambda fh: fh.write(data), binary=True)
        return path


def _cell(v: Any) -> str:
    """A number cell: integers as they are, floats to 6 significant digits (inf, -inf, nan spelled out)."""
    if isinstance(v, bool) or not isinstance(v, float):
        return str(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.6g}"
