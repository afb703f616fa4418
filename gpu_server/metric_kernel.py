"""The finite fast path's elementwise terms in one compiled pass over a CPU tile (optional: needs numba).

`gpu_server.metrics._add_finite_chunk` computes, for each element of a chunk, about thirty elementwise terms
(|d - b|, the relative error, the ULP error, the cosine summands ...) and then counts, maxima and float64 sums of
them. With torch ops that is some thirty passes over every tile. `kernel()` computes all of them in one pass: it
reads one bench and one device value, writes |d - b| and the five summands the sums need into the caller's
buffers, and accumulates the counts in registers. The sums and maxima stay torch's over those buffers, so
that every statistic is bit for bit what the torch path computes: each term is the same IEEE-754 operation on the
same float64 operands (no fast-math, no contraction into fused multiply-adds; numpy's error model, so that 0/0 is
NaN as in torch), and counts and maxima do not depend on the order of evaluation.

`kernel()` returns the compiled loop, or None without numba (then the torch path runs: same results, slower). Its
first call compiles it, about a second; the compiled code is cached beside this file or in numba's user cache when
either is writable, else compiled in memory once per process. docs/design.md §6.5 says where it is used.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger("gpu_server")

# the counts[] slots of the kernel
COUNT_KEYS = ("hundredth", "thousandth", "ten_thousandth", "small", "small_bad", "rel_bad", "ulp_over", "above",
              "below")

_lock = threading.Lock()
_kernel: Callable[..., None] | None = None
_tried = False


def _terms(b: Any, bbits: Any, d: Any, spb: Any, spf: Any, ae_out: Any, bmax: float, dmax: float, eps: float,
           small_value: float, small_atol: float, rtol: float, scale: float, min_exp: int, ulp_threshold: float,
           bounds: Any, bb: Any, with_bb: bool, sq: Any, rel: Any, ulp: Any, dot: Any, dd: Any,
           counts: Any) -> None:  # pragma: no cover - compiled by numba
    """One output's terms over one tile.

    b, d: the tile's bench and device values as float64 (finite, below 2^900: the caller checked); bbits: b's bits
    as int64 (the same memory); spb, spf: one int64 scratch tile and its float64 view. Writes |d - b| into ae_out,
    (b / bmax)^2 into bb when with_bb, the summands sq, rel, ulp, dot, dd, and adds the counts (COUNT_KEYS order).
    Each expression is one torch op of metrics._add_finite_chunk on the same operands; the loops are branch-free
    so that the compiler vectorises them."""
    n = b.shape[0]
    for i in range(n):   # 2^-eb, eb = max(floor(log2|b|), min_exp), from b's biased exponent
        eb = ((bbits[i] >> 52) & 0x7FF) - 1023
        spb[i] = (1023 - max(eb, min_exp)) << 52
    h0, h1, h2 = bounds[0], bounds[1], bounds[2]
    c_h0 = c_h1 = c_h2 = c_normal = c_small_bad = c_rel_bad = c_ulp_over = c_above = c_below = 0
    for i in range(n):
        bv = b[i]
        dv = d[i]
        ab = abs(bv)
        normal = ab > small_value
        nf = 1.0 if normal else 0.0
        bn = bv / bmax
        if with_bb:
            bb[i] = bn * bn
        df = dv - bv
        ae = abs(df)
        ae_out[i] = ae
        c_above += df > 0.0
        c_below += df < 0.0
        rl = ae / (ab + eps)
        c_h0 += rl < h0
        c_h1 += rl < h1
        c_h2 += rl < h2
        c_normal += normal
        c_small_bad += (ae > small_atol) & (not normal)
        tm = ae * nf
        sq[i] = tm * tm
        rn = rl * nf
        rel[i] = rn
        c_rel_bad += rn > rtol
        u = (ae * spf[i]) * scale
        ulp[i] = u
        c_ulp_over += u > ulp_threshold
        dn = dv / dmax
        dot[i] = bn * dn
        dd[i] = dn * dn
    counts[0] += c_h0
    counts[1] += c_h1
    counts[2] += c_h2
    counts[3] += n - c_normal
    counts[4] += c_small_bad
    counts[5] += c_rel_bad
    counts[6] += c_ulp_over
    counts[7] += c_above
    counts[8] += c_below


def _build() -> Callable[..., None] | None:
    try:
        import numba  # type: ignore[import-untyped]
    except ImportError:
        log.info("numba is not installed: the metrics run as torch ops (same results, slower; pip install numba)")
        return None

    jit = dict(nogil=True, error_model="numpy", fastmath=False)
    try:
        return numba.njit(cache=True, **jit)(_terms)   # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - no writable cache location: compile in memory
        return numba.njit(**jit)(_terms)   # type: ignore[no-any-return]


def kernel() -> Callable[..., None] | None:
    """The compiled `_terms`, or None without numba (decided once per process)."""
    global _kernel, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _kernel = _build()
                _tried = True
    return _kernel
