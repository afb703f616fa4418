"""The pooled errors' elementwise terms in one compiled pass over an output (optional: needs numba).

`gpu_server.checking.pooled._terms` computes, for each (subsampled) element of an output, the ULP errors of the
device and of the same-dtype run against the bench and a dozen terms of them, then sums them by groups. With torch
ops the elementwise part is some thirty passes over the elements, each a torch call (about 0.2 ms of an output's
0.6 ms at 16 Ki elements, more for small outputs, whose calls cost more than their work). `kernel()` computes it in
one pass: it writes the rows the sums read (the mask, p, q, w, e_s, e_s * sign, and e_d^2, e_s^2, p^2, w^2) into
the caller's buffers and counts the non-zero p. The sums stay torch's over those rows, so every statistic is bit
for bit what the torch ops give: each term is the same IEEE-754 operation on the same operands in the working
dtype (float32 or float64; constants of that dtype, no fast-math, no fused multiply-add), and a count does not
depend on the order.

Like gpu_server/judging/metric_kernel.py (whose loader it uses), it is compiled on its first call for each working
dtype and cached; `kernel()` returns None without numba.
"""
from __future__ import annotations

import math
from typing import Any

from gpu_server.judging.metric_kernel import LazyKernel


def _pooled_terms(b: Any, d: Any, s: Any, consts: Any, tmp: Any, buf: Any, extra: Any) -> int:  # pragma: no cover
    """b, d, s: the bench, device and same-dtype values in the working dtype (1-D, contiguous, n elements);
    consts: [tiny, max (the device dtype's normal range), 2^(P + 1), clip, tolerance, 1] in the working dtype;
    tmp: a scratch element of the working dtype (storing into it rounds a float64 to that dtype, here exactly);
    buf: (6, n) rows mask, p, q, w, e_s, e_s * sign; extra: (4, n) rows e_d^2, e_s^2, p^2, w^2. Returns how many p
    are not zero. Each line is the torch op of `pooled._terms` it stands for."""
    tiny, top, k, clip, tol, one = consts[0], consts[1], consts[2], consts[3], consts[4], consts[5]
    zero = one - one
    nz = 0
    for i in range(b.shape[0]):
        bv, dv, sv = b[i], d[i], s[i]
        mag = abs(bv)
        ok = (mag >= tiny) and (mag <= top) and math.isfinite(dv) and math.isfinite(sv)
        if not ok:   # torch.where(ok, x, one) for all three: every term is +0.0
            bv, dv, sv = one, one, one
        mant, ex = math.frexp(bv)             # torch.frexp (exact in any dtype)
        tmp[0] = mant                         # the mantissa in the working dtype (exact)
        m = tmp[0]
        tmp[0] = math.ldexp(1.0, -ex)         # torch.exp2(-exp): a power of two, exact in the working dtype
        scale = tmp[0]
        ed = (dv * scale - m) * k             # mul, sub_, mul_
        ed = clip if ed > clip else (-clip if ed < -clip else ed)   # clamp_(-clip, clip)
        es = (sv * scale - m) * k
        es = clip if es > clip else (-clip if es < -clip else es)
        sign = one if m > zero else -one      # mant.sign_() (the mantissa is never 0)
        p = ed - es
        w = ed * ed - es * es * tol           # sub(a, mul(c, tolerance)): two roundings
        buf[0, i] = one if ok else zero
        buf[1, i] = p
        buf[2, i] = p * sign
        buf[3, i] = w
        buf[4, i] = es
        buf[5, i] = es * sign
        extra[0, i] = ed * ed
        extra[1, i] = es * es
        extra[2, i] = p * p
        extra[3, i] = w * w
        nz += p != zero
    return nz


KERNEL = LazyKernel(_pooled_terms)


def kernel():
    """The compiled `_pooled_terms`, or None without numba (decided once per process)."""
    return KERNEL.get()
