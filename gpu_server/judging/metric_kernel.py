"""The finite fast path's elementwise terms in one compiled pass over a CPU tile (optional: needs numba).

`gpu_server.judging.metrics._add_finite_chunk` computes, for each element of a chunk, about thirty elementwise terms
(|d - b|, the relative error, the ULP error, the cosine summands ...) and then counts, maxima and float64 sums of
them. With torch ops that is some thirty passes over every tile. `kernel()` computes all of them in one pass over
a tile (the caller gives it one tile at a time; it also loops over several): it reads one bench and one device
value (float32 device values are widened in the loop, no copy), writes the five summands the sums need into the
caller's tile buffers, and accumulates the counts and the maxima. The sums stay torch's over those buffers, taken
by the caller while the tile is in the cache, so that every statistic is bit for bit what the torch path
computes: each term is the same IEEE-754 operation on the same float64 operands (no fast-math, no contraction into
fused multiply-adds; numpy's error model, so that 0/0 is NaN as in torch), and counts and maxima
do not depend on the order of evaluation.

`kernel()` returns the compiled loop, or None without numba (then the torch path runs: same results, slower). Its
first call for each type of device values (float32, float64) compiles it, 1-2 s each on this project's 2-core test
machine; the compiled code is cached beside this file or in numba's user cache when either is writable, else
compiled in memory once per process. docs/design.md §6.5 says where it is used.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import numpy

log = logging.getLogger("gpu_server")

# the counts[] slots of the kernel
COUNT_KEYS = ("hundredth", "thousandth", "ten_thousandth", "small", "small_bad", "rel_bad", "ulp_over", "above",
              "below")
MAX_KEYS = ("abs", "rel", "ulp")   # the maxes[] slots



def _terms(b: Any, bbits: Any, d: Any, spb: Any, spf: Any, ae: Any, tile: int, bmax: float, dmax: float,
           eps: float, small_value: float, small_atol: float, rtol: float, scale: float, min_exp: int,
           ulp_threshold: float, bounds: Any, bb: Any, with_bb: bool, sq: Any, rel: Any, ulp: Any, dot: Any, dd: Any,
           counts: Any, maxes: Any) -> None:  # pragma: no cover - compiled by numba
    """One output's terms over one chunk, tile by tile.

    b: the chunk's bench values as float64 (finite, below 2^900: the caller checked), bbits: b's bits as int64 (the
    same memory); d: the device values, float64 or float32 (each converted to float64 exactly, as the torch path's
    copy does); spb, spf: an int64 scratch tile and its float64 view, ae: a float64 scratch tile (`tile` elements
    each). Writes (b / bmax)^2 into bb when with_bb, the summands sq, rel, ulp, dot, dd (chunk-sized), adds the
    counts (COUNT_KEYS order) and raises maxes (float64, each +0.0 or above on entry) to the maxima of |d - b|, rel
    and ulp (MAX_KEYS order). Each expression is one torch op of metrics._add_finite_chunk on the same operands. The
    loops are branch-free so that the compiler vectorises them; the maxima are taken in a loop of their own over the
    tile just written (a running maximum inside the main loop would keep it from vectorising), and are exact
    whatever the order."""
    n = b.shape[0]
    h0, h1, h2 = bounds[0], bounds[1], bounds[2]
    c_h0 = c_h1 = c_h2 = c_normal = c_small_bad = c_rel_bad = c_ulp_over = c_above = c_below = 0
    top = maxes.view(numpy.int64)   # maxes as the integers of their bits (below)
    m_ae, m_rel, m_ulp = top[0], top[1], top[2]
    for lo in range(0, n, tile):
        hi = min(n, lo + tile)
        m = hi - lo
        bt, bits, dt = b[lo:hi], bbits[lo:hi], d[lo:hi]
        bbt, sqt, relt, ulpt, dott, ddt = bb[lo:hi], sq[lo:hi], rel[lo:hi], ulp[lo:hi], dot[lo:hi], dd[lo:hi]
        for i in range(m):   # 2^-eb, eb = max(floor(log2|b|), min_exp), from b's biased exponent
            eb = ((bits[i] >> 52) & 0x7FF) - 1023
            spb[i] = (1023 - max(eb, min_exp)) << 52
        for i in range(m):
            bv = bt[i]
            dv = float(dt[i])
            ab = abs(bv)
            normal = ab > small_value
            nf = 1.0 if normal else 0.0
            bn = bv / bmax
            if with_bb:
                bbt[i] = bn * bn
            df = dv - bv
            e = abs(df)
            ae[i] = e
            c_above += df > 0.0
            c_below += df < 0.0
            rl = e / (ab + eps)
            c_h0 += rl < h0
            c_h1 += rl < h1
            c_h2 += rl < h2
            c_normal += normal
            c_small_bad += (e > small_atol) & (not normal)
            tm = e * nf
            sqt[i] = tm * tm
            rn = rl * nf
            relt[i] = rn
            c_rel_bad += rn > rtol
            u = (e * spf[i]) * scale
            ulpt[i] = u
            c_ulp_over += u > ulp_threshold
            dn = dv / dmax
            dott[i] = bn * dn
            ddt[i] = dn * dn
        # the maxima of the tile's three terms, compared as the integers of their bits: every term is +0.0 or
        # above (never NaN, never -0.0: |d - b|, and products of it with non-negative factors), and non-negative
        # doubles order as their bit patterns do; an integer maximum vectorises, a float one (NaN-aware) does not
        aei, reli, ulpi = ae.view(numpy.int64), relt.view(numpy.int64), ulpt.view(numpy.int64)
        for i in range(m):
            m_ae = max(m_ae, aei[i])
            m_rel = max(m_rel, reli[i])
            m_ulp = max(m_ulp, ulpi[i])
    top[0], top[1], top[2] = m_ae, m_rel, m_ulp
    counts[0] += c_h0
    counts[1] += c_h1
    counts[2] += c_h2
    counts[3] += n - c_normal
    counts[4] += c_small_bad
    counts[5] += c_rel_bad
    counts[6] += c_ulp_over
    counts[7] += c_above
    counts[8] += c_below


class LazyKernel:
    """A function compiled with numba on first use (`get`), once per process, or None without numba; `loaded` is
    what `get` made so far, building nothing. The compiled code is cached beside the function's file or in numba's
    user cache when either is writable, else compiled in memory."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._lock = threading.Lock()
        self._kernel: Callable[..., Any] | None = None
        self._tried = False

    def build(self) -> Callable[..., Any] | None:
        try:
            import numba  # type: ignore[import-untyped]
        except ImportError:
            log.info("numba is not installed: the metrics run as torch ops (same results, slower; pip install numba)")
            return None
        jit = dict(nogil=True, error_model="numpy", fastmath=False)
        try:
            return numba.njit(cache=True, **jit)(self.fn)   # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001 - no writable cache location: compile in memory
            return numba.njit(**jit)(self.fn)   # type: ignore[no-any-return]

    def get(self) -> Callable[..., Any] | None:
        if not self._tried:
            with self._lock:
                if not self._tried:
                    self._kernel = self.build()
                    self._tried = True
        return self._kernel

    def loaded(self) -> Callable[..., Any] | None:
        return self._kernel


KERNEL = LazyKernel(_terms)


def loaded() -> Callable[..., None] | None:
    """The compiled `_terms` when `kernel()` has built it already in this process, else None (builds nothing)."""
    return KERNEL.loaded()


def kernel() -> Callable[..., None] | None:
    """The compiled `_terms`, or None without numba (decided once per process)."""
    return KERNEL.get()
