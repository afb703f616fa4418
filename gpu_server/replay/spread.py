"""The legitimate spread of a correct device (docs/standards.md, "Judging against the spread").

One same-dtype run on the bench host is one correct implementation; a device that accumulates in another order,
blocks differently or keeps its forward outputs with other rounding is another, and its error against the bench
scatters around the host's. So the verdict does not compare against the host's run alone but against a small set of
correct same-dtype implementations ("spread members"):

1. the host's own same-dtype run (as before; the checker computes it);
2. `SPREAD_RUNS` stochastic-rounding runs: the same replay where EVERY aten operator that rounds computes its result
   in a wider dtype (float32 for 16-bit outputs, float64 for float32 outputs) and rounds it to its output dtype
   stochastically (up with probability equal to the distance from the lower neighbour). Each op is then faithfully
   rounded (error < 1 ULP of its own output, unbiased), so each run is a correct implementation whose rounding
   decisions differ from the host's, op by op, through the whole call (forward outputs that a backward reuses
   included). Exact ops (copies, indexing, max, relu ...) are unchanged by construction.
3. one sequential-accumulation run, for calls with a matrix product: the same replay where every `mm`, `addmm`,
   `bmm` and `baddbmm` sums its K products one at a time in the accumulation dtype (float32; each product and each
   running sum rounded, no fused multiply-add), the other ops as on the host. That is the textbook order, and the
   least accurate one a correct device uses: a bench whose own products are blocked or split along K (cuBLAS on a
   GPU) otherwise accuses a device that sums more sequentially (a CPU's float32 `mm` on a CUDA bench, measured with
   bench/gpu_check.sh). Faithfully rounded runs (2.) carry no accumulation error at all. A call without a matrix
   product gets no such run (it would repeat the host's).

`forward_members` / `backward_members` return the outputs of these runs (flattened like
`replay.flatten_outputs`); the checker passes them, with the host's run, to the two-way status and the standards.
Randomness is seeded from the call's place in the training (rank, step, call name), not from the run id, so that
two runs of the same training give the same report (tests/report_identity.py compares them byte for byte).
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_server.replay.run import ReplayError, flatten_outputs, run_backward, run_forward

SPREAD_RUNS = 2             # stochastic-rounding runs per call (besides the host's same-dtype run)
SEQUENTIAL_RUNS = 1         # sequential-accumulation runs per call with a matrix product
_ROUNDED = (torch.float16, torch.bfloat16, torch.float32)
_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}
_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _seed(job: Any, run: int) -> int:
    key = f"{job.rank}|{job.step}|{job.name}|{run}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def _neighbour(r: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The next representable value of r towards +inf where `up`, towards -inf elsewhere (finite, nonzero r and
    zero handled; sign-magnitude bit patterns)."""
    bits = r.view(_INT[r.dtype])
    step = torch.where((r > 0) | ((r == 0) & up), 1, -1).to(bits.dtype)
    step = torch.where(up, step, -step)
    zero = r == 0
    tiny = torch.full_like(r, torch.finfo(r.dtype).tiny * torch.finfo(r.dtype).eps)   # smallest subnormal
    moved = (bits + step).view(r.dtype)
    return torch.where(zero, torch.where(up, tiny, -tiny), moved)


def stochastic_round(wide: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Round `wide` to `dtype`, up with probability (wide - lo) / (hi - lo): unbiased and faithful."""
    nearest = wide.to(dtype)
    back = nearest.to(wide.dtype)
    above = back > wide
    other = _neighbour(nearest, ~above)
    lo = torch.where(above, other.to(wide.dtype), back)
    hi = torch.where(above, back, other.to(wide.dtype))
    gap = hi - lo
    p_up = torch.where(gap > 0, (wide - lo) / gap, torch.zeros_like(wide))
    u = torch.rand(wide.shape, generator=gen, dtype=wide.dtype, device=wide.device)
    pick = torch.where(u < p_up, hi, lo).to(dtype)
    ok = torch.isfinite(wide) & torch.isfinite(pick) & (wide != back)
    return torch.where(ok, pick, nearest)


def _roundable(func) -> bool:
    schema = func._schema
    if schema.is_mutable or any(a.alias_info is not None for a in schema.returns):
        return False
    if torch.Tag.nondeterministic_seeded in func.tags or torch.Tag.inplace_view in func.tags:
        return False
    return func.overloadpacket not in _EXACT


# Conversions and copies round to nearest on every device (they are part of the program, not a kernel's choice).
_EXACT = {torch.ops.aten._to_copy, torch.ops.aten.clone, torch.ops.aten.copy, torch.ops.aten.lift_fresh_copy,
          torch.ops.aten.detach, torch.ops.aten.empty_like, torch.ops.aten.zeros_like, torch.ops.aten.ones_like,
          torch.ops.aten.full_like, torch.ops.aten.new_empty, torch.ops.aten.new_zeros, torch.ops.aten.new_ones,
          torch.ops.aten.new_full, torch.ops.aten.empty_strided}


# Matrix products: their sums may run in any order on a correct device (the sequential run).
_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default}


class StochasticRounding(TorchDispatchMode):
    """Every rounding aten op: computed in the wider dtype, stochastically rounded to its output dtype."""

    def __init__(self, seed: int):
        super().__init__()
        self.seed = seed
        self._gens: dict[torch.device, torch.Generator] = {}
        self.random = False   # the run drew random numbers: it is no reproduction of the call, discard it
        self.products = False   # the run met a matrix product (`_PRODUCTS`): the call gets a sequential run too

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random = True
        if func in _PRODUCTS:
            self.products = True
        out = func(*args, **kwargs)
        if not _roundable(func):
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        targets = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.dtype in _ROUNDED
                   and o.numel()]
        if not targets or "dtype" in kwargs:
            return out
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(t.dtype not in _ROUNDED and t.is_floating_point() for t in tensors):
            return out
        widen = {d: _WIDE[d] for d in _ROUNDED}
        w_args, w_kwargs = torch.utils._pytree.tree_map(
            lambda a: a.to(widen[a.dtype]) if isinstance(a, torch.Tensor) and a.dtype in widen else a, (args, kwargs))
        try:
            wide = func(*w_args, **w_kwargs)
        except Exception:  # noqa: BLE001 - an op without a wide kernel keeps its host rounding
            return out
        wides = wide if isinstance(wide, (tuple, list)) else (wide,)
        for i in targets:
            o, w = outs[i], wides[i] if i < len(wides) else None
            if not isinstance(w, torch.Tensor) or w.shape != o.shape or w.dtype != _WIDE[o.dtype]:
                continue
            o.copy_(stochastic_round(w, o.dtype, self._gen(o.device)))
        return out

    def _gen(self, device: torch.device) -> torch.Generator:
        gen = self._gens.get(device)
        if gen is None:
            gen = self._gens[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen


def sequential_product(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """`a @ b` (2-D, or 3-D batched) summed over k = 0, 1, ..., K-1 one product at a time in `acc`: each product
    and each running sum rounded to `acc` (no fused multiply-add)."""
    a, b = a.to(acc), b.to(acc)
    out = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=acc, device=a.device)
    for k in range(a.shape[-1]):
        out.add_(a[..., :, k:k + 1] * b[..., k:k + 1, :])
    return out


def _sequential(func, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The product op `func` with a sequential sum, rounded to its output dtype; None where it does not apply."""
    if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
        bias, (a, b), beta, alpha = None, args[:2], 0, 1
    else:
        bias, a, b = args[:3]
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    tensors = [t for t in (a, b, bias) if t is not None]
    if (not all(isinstance(t, torch.Tensor) for t in tensors) or a.dtype not in _ROUNDED
            or any(t.dtype != a.dtype or t.device != a.device for t in tensors) or a.shape[-1] < 2):
        return None
    acc = torch.float32
    out = sequential_product(a, b, acc)
    if alpha != 1:
        out = out * alpha
    if bias is not None and beta != 0:
        out = out + (bias.to(acc) if beta == 1 else bias.to(acc) * beta)
    return out.to(a.dtype)


class SequentialAccumulation(TorchDispatchMode):
    """Every matrix product (`_PRODUCTS`) summed sequentially in float32; every other op as on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.touched = False   # a product was replaced
        self.random = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random = True
        if func in _PRODUCTS:
            out = _sequential(func, args, kwargs)
            if out is not None:
                self.touched = True
                return out
        return func(*args, **kwargs)


def _usable(job: Any) -> bool:
    # a call with a replayed random stream draws it once per run; the stochastic runs would draw it again
    return not getattr(job, "rng_state", None)


def forward_members(job: Any, device: torch.device, match_threads: bool = True) -> list[list]:
    """Outputs of the stochastic-rounding forward runs (each flattened); [] where none can run."""
    return _members(job, job, lambda: flatten_outputs(run_forward(job, device, bench=False,
                                                                  match_threads=match_threads)))


def backward_members(fwd: Any, bwd: Any, device: torch.device, match_threads: bool = True) -> list[list]:
    """Gradients of the stochastic-rounding backward runs (forward and backward both stochastically rounded)."""
    return _members(fwd, bwd, lambda: run_backward(fwd, bwd, device, bench=False, match_threads=match_threads))


def _members(fwd: Any, seeded: Any, replay: Callable[[], list]) -> list[list]:
    """`replay()` under SPREAD_RUNS stochastic-rounding modes seeded from `seeded`, then, where those runs met a
    matrix product, under SEQUENTIAL_RUNS sequential-accumulation modes: the runs that completed (those before a
    failing one); [] when the call cannot have a spread (`fwd` replays a random stream, or the replay draws
    randomness of its own)."""
    if not _usable(fwd):
        return []
    members: list[list] = []
    modes: list[TorchDispatchMode] = [StochasticRounding(_seed(seeded, run)) for run in range(SPREAD_RUNS)]
    while modes:
        mode = modes.pop(0)
        try:
            with mode:
                out = replay()
        except (ReplayError, RuntimeError):
            return members
        if mode.random:   # internal randomness (dropout inside a fused op ...): no spread from this call
            return []
        if isinstance(mode, StochasticRounding) and mode.products and not modes:
            modes = [SequentialAccumulation() for _ in range(SEQUENTIAL_RUNS)]
        members.append(out)
    return members


class LazyRuns:
    """The spread runs of one call, computed on first use: most outputs pass against the host's run alone, and the
    spread can only make a verdict more lenient, so it is only run when some output needs it."""

    def __init__(self, compute: Callable[[], list[list]]):
        self._compute = compute
        self._runs: list[list] | None = None

    def runs(self) -> list[list]:
        if self._runs is None:
            self._runs = self._compute()
        return self._runs

    def output(self, i: int) -> Iterable:
        """The i-th compared output of every run (an iterable that computes the runs when iterated)."""
        return _Output(self, i)


class _Output:
    def __init__(self, runs: LazyRuns, i: int):
        self._lazy, self._i = runs, i

    def __iter__(self) -> Iterator:
        return iter([r[self._i] for r in self._lazy.runs() if self._i < len(r)])


def with_host(host: Any, others: Iterable) -> Iterator:
    """The host's same-dtype output first, then the spread runs' (computed only if the caller gets that far)."""
    yield host
    yield from others


# -- confidence bounds of rates on few elements ---------------------------------------------------------------------
