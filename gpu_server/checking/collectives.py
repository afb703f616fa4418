"""Judging torch.distributed collectives across ranks (issue 22, item 2): pure logic, no I/O.

Each member rank's agent sends one record per collective call (`Job` with `collective: CollectiveInfo`). `Matcher`
holds them by `CollectiveInfo.key` until every member rank's record is there, then decides the collective:

- **mismatch**: the records must agree on the API, the reduce op, the root (broadcast's src, reduce's dst), the
  dtype and the input shapes the API requires equal (all_to_all_single: each rank's output splits against what the
  others send it; point-to-point: a send and a recv, the received buffer's dtype and shape against the sent
  tensor's). Otherwise every record gets ERROR and the Finding names the minority (the answer to "why does my job
  hang");
- **unfinished**: a record whose output was never taken (an async call never waited, or the call raised) gets SKIP
  saying why; the other ranks are still judged, their reference coming from the inputs;
- **matched**: each rank gets the reference its output is judged against (`RankVerdict`):
    * order-dependent reductions (sum, avg, product of floating tensors): `bench` in float64 (complex128), `same` =
      the reduction in the device dtype accumulating in group-rank order (every step rounded to the device dtype),
      `members` = the same reduction in other orders a correct backend may use (accumulating in a wider dtype and
      rounding once, a pairwise tree, the reverse order, each ring rotation; for avg, first each input times 1/n as
      NCCL does), at most `MAX_MEMBERS`. avg is the sum divided by n in the device dtype. status None: the caller
      judges with the standards;
    * exact results (min, max, band, bor, bxor, integer and bool reductions, gathers, broadcast, all_to_all,
      recv): `same` = the exact result in the device dtype, `members` = [], and the output must be bit-exact
      (NaN equals NaN; min/max: +0 equals -0 and an element where an input is NaN is not compared, backends differ
      there): otherwise status ERROR naming the first differing element, else None (the standards show pass).
      Integer avg is the sum (wrapping in the device dtype) divided by n, truncated (NCCL's SumPostDiv);
    * nothing to compare (a send, reduce's non-root ranks): status None with `bench == same == []`;
- **suspect rank** (sum/avg of real floating tensors): when some outputs deviate from the float64 reference by more
  than any summation order in the device dtype can (n * u * sum_j |x_j| per element, u the unit roundoff, or
  `SAFETY` times the spread of `same` and `members`, plus 2 ULP), the deviation d is fitted as c * x_j for each rank
  j's input; the rank whose input explains at least `EXPLAINED` of it (and clearly more than any other rank's) is
  named in the Finding;
- **missing**: a collective still incomplete when all its member ranks have ended (`rank_ended`), or when the server
  is done (`finish`): the ranks that sent it get SKIP naming the missing ranks and where they stopped;
- **evicted**: the records held pass `budget` bytes: the oldest incomplete collectives get SKIP naming
  `--collective-memory-mb` (and so do their records that arrive later).

Everything runs on the CPU tensors of the records. Nothing here raises from `add`: a record that cannot be judged
gets SKIP with the reason.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import torch

from gpu_server.collective_info import CollectiveInfo
from gpu_server.job import Job
from gpu_server.replay.run import flatten_outputs
from gpu_server.seqset import SeqSet
from gpu_server.statuses import ERROR, SKIP
from protos.apis import COLLECTIVES, POINT_TO_POINT
from protos.trees import iter_leaves

log = logging.getLogger("gpu_server")

MAX_MEMBERS = 8          # other legitimate reduction orders per output
SAFETY = 4.0             # times the spread of the legitimate orders, before a deviation counts
EXPLAINED = 0.9          # fraction of a deviation one rank's input must explain to be named
MARGIN = 0.05            # ... and by how much more than any other rank's input
MAX_EVICTED = 1 << 16    # evicted collectives remembered (their later records are SKIP at once)

SENDS = frozenset({"send", "isend"})
RECVS = frozenset({"recv", "irecv"})
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})
ORDERED_OPS = frozenset({"sum", "avg", "product"})
BITWISE_OPS = frozenset({"band", "bor", "bxor"})
HANG = "a collective called differently on some ranks makes the job hang or compute garbage"

Key = tuple[str, str, tuple[int, ...], int]


@dataclasses.dataclass
class RankVerdict:
    job: Job                     # this rank's record
    bench: list[Any] | None           # reference outputs in float64 (complex128; integer/bool outputs: exact, in their
                                 # dtype), aligned with flatten_outputs(job.output); None: no comparison; []: nothing
                                 # to compare (a send, reduce's non-root ranks)
    same: list[Any] | None            # the reference in the device dtype, in the canonical order (group-rank order)
    members: list[list[Any]]          # other legitimate results in the device dtype (other reduction orders), each like
                                 # `same`; [] for exact results
    status: str | None           # None: judge with the standards (the caller compares); else ERROR or SKIP
    message: str                 # why, when status is fixed; else "" (or a note)


@dataclasses.dataclass
class Finding:
    """One collective, decided."""

    key: tuple[Any, ...]         # CollectiveInfo.key
    api: str                     # "all_reduce" (the majority's, on a mismatch)
    step: int
    kind: str                    # "matched", "mismatch", "missing", "unfinished", "evicted"
    message: str                 # one line, names ranks, calls and the difference; "" when matched, nothing to say
    ranks: tuple[int, ...]       # member ranks
    named: tuple[int, ...]       # ranks the message accuses (the mismatching / missing / suspect ranks)
    verdicts: dict[int, RankVerdict]   # by global rank, one per record received


class _Malformed(Exception):
    """The reference cannot be computed; str() says why."""


@dataclasses.dataclass
class _Open:
    key: Key
    jobs: dict[int, Job]
    nbytes: int = 0


# -- text --------------------------------------------------------------------------------------------------------

def _span(ranks: Iterable[int], limit: int = 16) -> str:
    """Sorted ranks, runs of 4 or more as a-b: "0-3", "0, 1, 2", "0, 4-7"."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 3:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    if len(parts) > limit:
        return ", ".join(parts[:limit]) + f", ... ({len(rs)} ranks)"
    return ", ".join(parts)


def _who(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {_span(rs)}"


def _where(info: CollectiveInfo) -> str:
    if info.p2p:
        return f"message #{info.seq} from rank {info.ranks[0]} to rank {info.ranks[1]}"
    return f"collective #{info.seq} of group {info.group} ({_who(info.ranks)})"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _tensor_text(t: Any, free_dim0: bool = False) -> str:
    if not isinstance(t, torch.Tensor):
        return "no tensor" if t is None else f"a {type(t).__name__}"
    dims = [str(d) for d in t.shape]
    if free_dim0 and dims:
        dims[0] = "*"
    return f"{_dtype(t)} [{', '.join(dims)}]"


def _list_text(xs: Any, shapes: bool) -> str:
    if not isinstance(xs, (list, tuple)):
        return _tensor_text(xs)
    if not xs:
        return "an empty list"
    if not all(isinstance(x, torch.Tensor) for x in xs):
        return "a list of " + ", ".join(sorted({type(x).__name__ for x in xs}))
    dtypes = sorted({_dtype(x) for x in xs})
    if not shapes:
        return f"{len(xs)} × {'/'.join(dtypes)}"
    texts = [_tensor_text(x) for x in xs]
    if len(set(texts)) == 1:
        return f"{len(xs)} × {texts[0]}"
    shown = ", ".join("[" + ", ".join(str(d) for d in x.shape) + "]" for x in xs[:8])
    return f"{'/'.join(dtypes)} {shown}{', ...' if len(xs) > 8 else ''} ({len(xs)} tensors)"


def _first_arg(job: Job) -> Any:
    return job.args[0] if isinstance(job.args, (tuple, list)) and job.args else None


def _signature(job: Job) -> str:
    """What must be equal on every rank of a collective, as the message shows it."""
    c = job.collective
    assert c is not None
    api, parts = job.api, []
    if api in REDUCING:
        parts.append(c.op or "no reduce op")
    if api == "reduce":
        parts.append(f"dst {c.root}")
    if api == "broadcast":
        parts.append(f"src {c.root}")
    x = _first_arg(job)
    if api in ("reduce_scatter", "all_to_all"):
        parts.append(_list_text(x, shapes=api == "reduce_scatter"))
    else:
        parts.append(_tensor_text(x, free_dim0=api == "all_to_all_single"))
    return f"Distributed.{api} ({', '.join(parts)})"


# -- reductions --------------------------------------------------------------------------------------------------

def _combine(op: str, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if dtype == torch.bool:
        table = {"sum": torch.logical_or, "product": torch.logical_and, "min": torch.logical_and,
                 "max": torch.logical_or, "band": torch.logical_and, "bor": torch.logical_or,
                 "bxor": torch.logical_xor}
        if op not in table:
            raise _Malformed(f"reduce op {op} of bool tensors is not defined")
        return table[op]
    if op in BITWISE_OPS and (dtype.is_floating_point or dtype.is_complex):
        raise _Malformed(f"bitwise reduce op {op} of {str(dtype).replace('torch.', '')} tensors is not defined")
    if op in ("min", "max") and dtype.is_complex:
        raise _Malformed(f"reduce op {op} of complex tensors is not defined")
    table2: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "sum": torch.add, "avg": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum,
        "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
    if op not in table2:
        raise _Malformed(f"reduce op '{op}' is not recorded" if not op else f"reduce op '{op}' is not known")
    return table2[op]


def _fold(xs: Sequence[torch.Tensor], order: Sequence[int],
          f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    acc = xs[order[0]].clone()
    for i in order[1:]:
        acc = f(acc, xs[i])
    return acc


def _tree(xs: Sequence[torch.Tensor], f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    level = list(xs)
    while len(level) > 1:
        nxt = [f(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].clone()


def _ordered(op: str, dtype: torch.dtype) -> bool:
    """An op whose result depends on the order of accumulation (rounded per step)."""
    return op in ORDERED_OPS and (dtype.is_floating_point or dtype.is_complex)


def _exact_reduce(op: str, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    f = _combine(op, xs[0].dtype)
    out = _fold(xs, range(len(xs)), f)
    if op == "avg":
        if xs[0].dtype == torch.bool:
            raise _Malformed("reduce op avg of bool tensors is not defined")
        out = torch.div(out, len(xs), rounding_mode="trunc")
    return out


def _wide_of(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype.is_complex else torch.float64


def _accumulator(dtype: torch.dtype) -> torch.dtype | None:
    """The wider dtype a backend may accumulate in before rounding once."""
    return {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64,
            torch.complex64: torch.complex128}.get(dtype)


def _ordered_reduce(op: str, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(float64 bench, same: group-rank order in the device dtype, members: other legitimate orders)."""
    n, dtype = len(xs), xs[0].dtype
    f = _combine(op, dtype)
    canonical = list(range(n))
    wide = [x.to(_wide_of(dtype)) for x in xs]
    bench = _fold(wide, canonical, f)
    if op == "avg":
        bench = bench / n

    def finish(t: torch.Tensor) -> torch.Tensor:
        return t / n if op == "avg" else t

    same = finish(_fold(xs, canonical, f))
    members: list[torch.Tensor] = []
    if op == "avg":   # NCCL's PreMulSum: every input times 1/n (in the device dtype), then summed
        scale = torch.tensor(1.0 / n, dtype=dtype)
        members.append(_fold([x * scale for x in xs], canonical, f))
    acc = _accumulator(dtype)
    if acc is not None:
        members.append(finish(_fold([x.to(acc) for x in xs], canonical, f)).to(dtype))
    if n > 3:
        members.append(finish(_tree(xs, f)))
    orders = [list(reversed(canonical))] + [canonical[k:] + canonical[:k] for k in range(1, n)]
    seen = {(frozenset(canonical[:2]), tuple(canonical[2:]))}
    for order in orders:
        if len(members) >= MAX_MEMBERS:
            break
        shape = (frozenset(order[:2]), tuple(order[2:]))   # the first two commute: a+b == b+a bitwise
        if shape not in seen:
            seen.add(shape)
            members.append(finish(_fold(xs, order, f)))
    return bench, same, members[:MAX_MEMBERS]


def _bench_of(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
        return t.to(_wide_of(t.dtype))
    return t


# -- bit-exact comparison ----------------------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _differs(expected: torch.Tensor, got: torch.Tensor, loose: bool) -> torch.Tensor:
    """Flat bool mask of the elements whose bits differ (NaN equals NaN; `loose`: +0 equals -0)."""
    if expected.is_complex():
        er, gr = torch.view_as_real(expected.contiguous()), torch.view_as_real(got.contiguous())
        return _differs(er, gr, loose).reshape(-1, 2).any(1)
    e, g = expected.contiguous().reshape(-1), got.contiguous().reshape(-1)
    it = _INT_OF_SIZE[e.element_size()]
    diff = e.view(it) != g.view(it)
    if e.is_floating_point():
        ef, gf = e.to(torch.float64), g.to(torch.float64)
        diff &= ~(ef.isnan() & gf.isnan())
        if loose:
            diff &= ~((ef == 0) & (gf == 0))
    return diff


def _bits(t: torch.Tensor, k: int) -> str:
    flat = t.contiguous().reshape(-1)
    if t.is_complex():
        return ""
    size = flat.element_size()
    raw = int(flat.view(_INT_OF_SIZE[size])[k]) & ((1 << (8 * size)) - 1)
    return f" (0x{raw:0{2 * size}x})"


def _value(t: torch.Tensor, k: int) -> str:
    v = t.contiguous().reshape(-1)[k]
    item = v.to(torch.float64).item() if t.is_floating_point() and t.element_size() == 1 else v.item()
    return f"{item!r}{_bits(t, k)}"


def _unravel(k: int, shape: Sequence[int]) -> list[int]:
    idx = []
    for s in reversed(list(shape)):
        idx.append(k % s if s else 0)
        k = k // s if s else 0
    return idx[::-1]


@dataclasses.dataclass
class _Exact:
    outputs: list[torch.Tensor]                       # the exact outputs, in the device dtype
    labels: list[list[tuple[int, str]]]               # per output: (end row along dim 0, where it came from)
    ignore: list[torch.Tensor | None] = dataclasses.field(default_factory=list)   # flat masks not compared
    loose: bool = False                                # +0 equals -0 (min, max)


def _first_difference(ref: _Exact, device: list[Any]) -> str | None:
    if len(device) != len(ref.outputs):
        return f"its output has {len(device)} tensors where {len(ref.outputs)} are expected"
    for i, (e, g) in enumerate(zip(ref.outputs, device)):
        label = _label(ref.labels[i] if i < len(ref.labels) else [], 0)
        name = f"output {i}" if len(ref.outputs) > 1 else "its output"
        if not isinstance(g, torch.Tensor):
            return f"{name} is {'None' if g is None else 'a ' + type(g).__name__}, a tensor is expected"
        if g.dtype != e.dtype:
            return f"{name} is {_dtype(g)}, {_dtype(e)} expected ({label})"
        if tuple(g.shape) != tuple(e.shape):
            return f"{name} has shape {list(g.shape)}, {list(e.shape)} expected ({label})"
        if e.numel() == 0:
            continue
        diff = _differs(e, g, ref.loose)
        mask = ref.ignore[i] if i < len(ref.ignore) else None
        if mask is not None:
            diff &= ~mask
        if bool(diff.any()):
            k = int(diff.nonzero()[0, 0])
            idx = _unravel(k, e.shape)
            count = int(diff.sum())
            row = idx[0] if idx else 0
            where = _label(ref.labels[i] if i < len(ref.labels) else [], row)
            return (f"{name} differs at element {idx} ({where}): expected {_value(e, k)}, got {_value(g, k)}"
                    f"{f'; {count} elements differ' if count > 1 else ''}")
    return None


def _label(parts: list[tuple[int, str]], row: int) -> str:
    for end, text in parts:
        if row < end:
            return text
    return parts[-1][1] if parts else "the reference"


# -- the reference of each rank ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Ref:
    exact: _Exact | None = None
    operands: list[torch.Tensor] | None = None    # an order-dependent reduction's n operands, group-rank order
    nothing: str = ""                              # no output to compare: why


def _tensor_in(jobs: dict[int, Job], r: int, what: str = "input tensor") -> torch.Tensor:
    x = _first_arg(jobs[r])
    if not isinstance(x, torch.Tensor):
        raise _Malformed(f"rank {r}'s record has no {what}")
    return x


def _list_in(jobs: dict[int, Job], r: int, n: int) -> list[torch.Tensor]:
    xs = _first_arg(jobs[r])
    if not isinstance(xs, (list, tuple)) or not all(isinstance(x, torch.Tensor) for x in xs):
        raise _Malformed(f"rank {r}'s record has no list of input tensors")
    if len(xs) != n:
        raise _Malformed(f"rank {r}'s input list has {len(xs)} tensors for a group of {n} ranks")
    return list(xs)


def _reduction(op: str, operands: list[torch.Tensor]) -> _Ref:
    if _ordered(op, operands[0].dtype):
        return _Ref(operands=operands)
    out = _exact_reduce(op, operands)
    ignore = None
    if op in ("min", "max") and out.is_floating_point():
        ignore = torch.stack([x.reshape(-1).isnan() for x in operands]).any(0)
    return _Ref(exact=_Exact([out], [[(out.shape[0] if out.dim() else 1, f"the {op} of every rank's input")]],
                             [ignore], loose=op in ("min", "max")))


def _rows(xs: Sequence[torch.Tensor], labels: Sequence[str]) -> list[tuple[int, str]]:
    out, end = [], 0
    for x, text in zip(xs, labels):
        end += x.shape[0] if x.dim() else 1
        out.append((end, text))
    return out


def _cat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(xs)) if xs[0].dim() == 0 else torch.cat(list(xs), 0)


def _splits(job: Job, name: str, n: int, r: int) -> list[int] | None:
    sizes = job.kwargs.get(name) if isinstance(job.kwargs, dict) else None
    if sizes is None:
        return None
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise _Malformed(f"rank {r}'s {name} is not a list of sizes")
    if len(sizes) != n:
        raise _Malformed(f"rank {r}'s {name} has {len(sizes)} sizes for a group of {n} ranks")
    return [int(s) for s in sizes]


def _input_splits(jobs: dict[int, Job], r: int, n: int) -> list[int]:
    x = _tensor_in(jobs, r)
    rows = x.shape[0] if x.dim() else 0
    sizes = _splits(jobs[r], "input_split_sizes", n, r)
    if sizes is None:
        if rows % n:
            raise _Malformed(f"rank {r}'s input of {rows} rows cannot be split evenly among {n} ranks")
        return [rows // n] * n
    if sum(sizes) != rows:
        raise _Malformed(f"rank {r}'s input_split_sizes add up to {sum(sizes)}, its input has {rows} rows")
    return sizes


def _split_mismatch(jobs: dict[int, Job], ranks: tuple[int, ...]) -> tuple[str, tuple[int, ...]] | None:
    """all_to_all_single: each rank's output splits against what the others send it."""
    n = len(ranks)
    ins = {r: _input_splits(jobs, r, n) for r in ranks}
    for g, r in enumerate(ranks):
        outs = _splits(jobs[r], "output_split_sizes", n, r)
        got = [ins[j][g] for j in ranks]
        if outs is None:
            if len(set(got)) > 1:
                j = next(jj for jj, s in zip(ranks, got) if s != got[0])
                return (f"rank {r} expects equal splits (no output_split_sizes) but rank {ranks[0]} sends it "
                        f"{got[0]} rows and rank {j} {ins[j][g]}", (r, j))
            continue
        for gj, j in enumerate(ranks):
            if outs[gj] != got[gj]:
                return (f"rank {r} expects {outs[gj]} rows from rank {j} (output_split_sizes) but rank {j} sends it "
                        f"{got[gj]} (input_split_sizes)", (r, j) if r != j else (r,))
    return None


def _references(api: str, info: CollectiveInfo, jobs: dict[int, Job]) -> dict[int, _Ref]:
    ranks, n = info.ranks, len(info.ranks)
    if api in ("all_reduce", "reduce"):
        ref = _reduction(info.op, [_tensor_in(jobs, r) for r in ranks])
        if api == "all_reduce":
            return {r: ref for r in ranks}
        return {r: ref if r == info.root else _Ref(nothing=f"not the root of the reduce (rank {info.root})")
                for r in ranks}
    if api == "broadcast":
        x = _tensor_in(jobs, info.root, "input tensor (the root of the broadcast)")
        ex = _Exact([x], [_rows([x], [f"rank {info.root}'s input"])])
        return {r: _Ref(exact=ex) for r in ranks}
    if api == "all_gather":
        xs = [_tensor_in(jobs, r) for r in ranks]
        ex = _Exact(xs, [_rows([x], [f"rank {r}'s input"]) for x, r in zip(xs, ranks)])
        return {r: _Ref(exact=ex) for r in ranks}
    if api == "all_gather_into_tensor":
        xs = [_tensor_in(jobs, r) for r in ranks]
        ex = _Exact([_cat(xs)], [_rows(xs, [f"rank {r}'s input" for r in ranks])])
        return {r: _Ref(exact=ex) for r in ranks}
    if api == "reduce_scatter":
        lists = [_list_in(jobs, r, n) for r in ranks]
        return {r: _reduction(info.op, [lst[g] for lst in lists]) for g, r in enumerate(ranks)}
    if api == "reduce_scatter_tensor":
        xs = [_tensor_in(jobs, r) for r in ranks]
        if xs[0].dim() == 0 or xs[0].shape[0] % n:
            raise _Malformed(f"an input of shape {list(xs[0].shape)} cannot be scattered in {n} equal chunks")
        rows = xs[0].shape[0] // n
        return {r: _reduction(info.op, [x.narrow(0, g * rows, rows) for x in xs]) for g, r in enumerate(ranks)}
    if api == "all_to_all":
        lists = [_list_in(jobs, r, n) for r in ranks]
        return {r: _Ref(exact=_Exact([lst[g] for lst in lists],
                                     [_rows([lst[g]], [f"rank {j}'s input_list[{g}]"])
                                      for lst, j in zip(lists, ranks)]))
                for g, r in enumerate(ranks)}
    if api == "all_to_all_single":
        inputs = {r: _tensor_in(jobs, r) for r in ranks}
        ins = {r: _input_splits(jobs, r, n) for r in ranks}
        refs = {}
        for g, r in enumerate(ranks):
            pieces = [inputs[j].narrow(0, sum(ins[j][:g]), ins[j][g]) for j in ranks]
            refs[r] = _Ref(exact=_Exact([torch.cat(pieces, 0)],
                                        [_rows(pieces, [f"rank {j}'s input rows {sum(ins[j][:g])}-"
                                                        f"{sum(ins[j][:g + 1]) - 1}" for j in ranks])]))
        return refs
    raise _Malformed(f"Distributed.{api} is not a collective the server checks")


# -- judging -----------------------------------------------------------------------------------------------------

def _unfinished_why(job: Job) -> str:
    c = job.collective
    assert c is not None
    if c.error:
        return f"Distributed.{job.api} raised on rank {job.rank}: {c.error}"
    if c.async_op:
        return (f"Distributed.{job.api} on rank {job.rank} was asynchronous and never waited on: its output was "
                "never taken")
    return f"Distributed.{job.api} on rank {job.rank} did not finish: its output was never taken"


def _unfinished(job: Job) -> bool:
    return job.collective is not None and job.collective.unfinished


def _skip(job: Job, why: str) -> RankVerdict:
    return RankVerdict(job, None, None, [], SKIP, why)


def _position(info: CollectiveInfo, rank: int) -> int:
    return info.ranks.index(rank) if rank in info.ranks else len(info.ranks)


def _first_job(info: CollectiveInfo, jobs: dict[int, Job]) -> Job:
    return jobs[min(jobs, key=lambda r: _position(info, r))]


def _judge(key: Key, jobs: dict[int, Job]) -> Finding:
    first = _first_job(_info_of(key), jobs)
    info = first.collective or _info_of(key)
    try:
        if info.p2p:
            return _judge_p2p(key, info, jobs)
        return _judge_collective(key, info, jobs)
    except Exception as exc:  # noqa: BLE001 - one collective that cannot be judged must not stop the others
        log.exception("internal error while judging %s", _where(info))
        why = f"{_where(info)}: internal error while judging: {type(exc).__name__}: {exc}"
        return Finding(key, first.api, first.step, "matched", why, info.ranks, (),
                       {r: _skip(j, why) for r, j in jobs.items()})


def _info_of(key: Key) -> CollectiveInfo:
    return CollectiveInfo(job=key[0], group=key[1], ranks=key[2], seq=key[3])


def _mismatch(key: Key, info: CollectiveInfo, jobs: dict[int, Job], api: str, step: int, text: str,
              named: tuple[int, ...]) -> Finding:
    message = f"{_where(info)}: {text}"
    return Finding(key, api, step, "mismatch", message, info.ranks, tuple(sorted(named)),
                   {r: RankVerdict(j, None, None, [], ERROR, message) for r, j in jobs.items()})


def _judge_collective(key: Key, info: CollectiveInfo, jobs: dict[int, Job]) -> Finding:
    ranks = info.ranks
    sigs = {r: _signature(jobs[r]) for r in ranks}
    groups: dict[str, list[int]] = {}
    for r in ranks:
        groups.setdefault(sigs[r], []).append(r)
    order = sorted(groups.values(), key=lambda rs: (-len(rs), _position(info, rs[0])))
    major = order[0]
    lead = jobs[major[0]]
    api, step = lead.api, lead.step
    if len(order) > 1:
        clauses = [f"{_who(rs)} call{'s' if len(rs) == 1 else ''} {sigs[rs[0]]}" for rs in order]
        text = f"{clauses[0]} and {', '.join(clauses[1:])}: {HANG}"
        return _mismatch(key, info, jobs, api, step, text, tuple(r for rs in order[1:] for r in rs))
    info = lead.collective or info
    if api == "all_to_all_single":
        try:
            split = _split_mismatch(jobs, ranks)
        except _Malformed:
            split = None   # said below, with the reference
        if split is not None:
            return _mismatch(key, info, jobs, api, step, f"{split[0]}: {HANG}", split[1])

    verdicts: dict[int, RankVerdict] = {}
    unfinished = [r for r in ranks if _unfinished(jobs[r])]
    for r in unfinished:
        verdicts[r] = _skip(jobs[r], _unfinished_why(jobs[r]))
    kind = "unfinished" if unfinished else "matched"
    notes = [_unfinished_why(jobs[r]) for r in unfinished]
    try:
        refs = _references(api, info, jobs)
    except _Malformed as exc:
        why = f"{_where(info)}: the reference cannot be computed: {exc}"
        for r in ranks:
            verdicts.setdefault(r, _skip(jobs[r], why))
        return Finding(key, api, step, kind, "; ".join(notes + [why]), ranks, tuple(unfinished), verdicts)

    cache: dict[int, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}
    errors: list[tuple[int, str]] = []
    for r in ranks:
        if r in verdicts:
            continue
        job, ref = jobs[r], refs[r]
        if ref.nothing:
            verdicts[r] = RankVerdict(job, [], [], [], None, ref.nothing)
            continue
        device = flatten_outputs(job.output)
        if ref.exact is not None:
            bench = [_bench_of(t) for t in ref.exact.outputs]
            diff = _first_difference(ref.exact, device)
            if diff is None:
                verdicts[r] = RankVerdict(job, bench, list(ref.exact.outputs), [], None, "")
            else:
                msg = f"Distributed.{api} on rank {r}: {diff}: {_exact_why(api, info.op)}"
                verdicts[r] = RankVerdict(job, bench, list(ref.exact.outputs), [], ERROR, msg)
                errors.append((r, msg))
            continue
        assert ref.operands is not None
        got = cache.get(id(ref.operands))
        if got is None:
            got = cache[id(ref.operands)] = _ordered_reduce(info.op, ref.operands)
        b, s, ms = got
        verdicts[r] = RankVerdict(job, [b], [s], [[m] for m in ms], None, "")
        if len(device) != 1 or not isinstance(device[0], torch.Tensor):
            msg = (f"Distributed.{api} on rank {r}: its output has {len(device)} values where one tensor "
                   f"{_tensor_text(s)} is expected")
            verdicts[r].status, verdicts[r].message = ERROR, msg
            errors.append((r, msg))

    named: tuple[int, ...] = tuple(unfinished)
    parts: list[str] = []
    if errors:
        named = tuple(sorted({r for r, _ in errors} | set(unfinished)))
        others = f" (and {_who([r for r, _ in errors[1:]])})" if len(errors) > 1 else ""
        parts.append(errors[0][1] + others)
    elif api in REDUCING and info.op in ("sum", "avg"):
        suspect = _suspect(info, refs, verdicts)
        if suspect is not None:
            parts.append(suspect[0])
            named = tuple(sorted(set(suspect[1]) | set(unfinished)))
    parts += notes
    message = f"{_where(info)}: " + "; ".join(parts) if parts else ""
    return Finding(key, api, step, kind, message, ranks, named, verdicts)


def _exact_why(api: str, op: str) -> str:
    if api in REDUCING:
        return f"a {op} reduction of these inputs has one exact result"
    if api == "recv":
        return "a message arrives bit-exact"
    return f"Distributed.{api} copies bits: its result is exact"


def _suspect(info: CollectiveInfo, refs: dict[int, _Ref],
             verdicts: dict[int, RankVerdict]) -> tuple[str, tuple[int, ...]] | None:
    """Outputs of a float sum/avg beyond every legitimate order, and the rank whose input explains the deviation."""
    n = len(info.ranks)
    deviating: list[int] = []
    d_parts: list[torch.Tensor] = []
    x_parts: list[list[torch.Tensor]] = [[] for _ in range(n)]
    allowed_of: dict[int, torch.Tensor] = {}                   # by operands: what any legitimate order may differ
    judged: dict[int, list[tuple[torch.Tensor, bool]]] = {}     # by operands: outputs seen, and whether they deviate
    for r in info.ranks:
        v, ref = verdicts.get(r), refs.get(r)
        if v is None or v.status is not None or ref is None or ref.operands is None or not v.bench:
            continue
        out, bench = flatten_outputs(v.job.output), v.bench[0]
        if (len(out) != 1 or not isinstance(out[0], torch.Tensor) or not out[0].is_floating_point()
                or tuple(out[0].shape) != tuple(bench.shape) or not bench.is_floating_point()):
            continue
        key, device = id(ref.operands), out[0]
        earlier = next((dev for o, dev in judged.get(key, []) if torch.equal(o, device)), None)
        if earlier is not None:   # an all_reduce gives every rank the same output: judged once
            if earlier:
                deviating.append(r)
            continue
        d = device.to(torch.float64) - bench
        allowed = allowed_of.get(key)
        if allowed is None:
            fi = torch.finfo(ref.operands[0].dtype)
            magnitude = sum((x.to(torch.float64).abs() for x in ref.operands), torch.zeros_like(bench))
            if info.op == "avg":
                magnitude = magnitude / n
            legit = [m[0] for m in [v.same or []] + v.members if m]
            spread = (torch.stack([(m.to(torch.float64) - bench).abs() for m in legit]).amax(0) if legit
                      else torch.zeros_like(bench))
            allowed = allowed_of[key] = (torch.maximum(SAFETY * spread, n * (fi.eps / 2) * magnitude)
                                         + 2 * fi.eps * bench.abs() + fi.tiny)
        finite = torch.isfinite(d) & torch.isfinite(bench) & torch.isfinite(allowed)
        beyond = bool((finite & (d.abs() > allowed)).any())
        judged.setdefault(key, []).append((device, beyond))
        if not beyond:
            continue
        deviating.append(r)
        d_parts.append(d[finite])
        for j, x in enumerate(ref.operands):
            x_parts[j].append(x.to(torch.float64)[finite] / (n if info.op == "avg" else 1))
    if not deviating:
        return None
    d = torch.cat(d_parts)
    dd = float((d * d).sum())
    fits = []
    for j in range(n):
        x = torch.cat(x_parts[j])
        xx, dx = float((x * x).sum()), float((d * x).sum())
        fits.append((dx * dx / (dd * xx) if dd > 0 and xx > 0 else 0.0, dx / xx if xx > 0 else 0.0, j))
    fits.sort(reverse=True)
    what = "sum" if info.op == "sum" else "average"
    lead = f"the outputs of {_who(deviating)} differ from the float64 {what} of every rank's input"
    best = fits[0]
    if best[0] >= EXPLAINED and (len(fits) == 1 or fits[1][0] <= best[0] - MARGIN):
        j = info.ranks[best[2]]
        scale = "input" if info.op == "sum" else f"input / {n}"
        return (f"{lead} by ~{best[1]:.3g} × rank {j}'s {scale}: rank {j}'s contribution looks wrong", (j,))
    tied = [info.ranks[f[2]] for f in fits if f[0] >= EXPLAINED and f[0] > best[0] - MARGIN]
    if len(tied) > 1:   # e.g. gradients that an earlier all_reduce made equal on every rank
        return (f"{lead} by ~{best[1]:.3g} × one input, but ranks {', '.join(map(str, sorted(tied)))} sent the same "
                "input: which contribution is wrong cannot be told from this collective (see the collectives whose "
                "inputs differ)", tuple(deviating))
    return (f"{lead} by more than any reduction order explains, and no single rank's input explains the difference",
            tuple(deviating))


def _judge_p2p(key: Key, info: CollectiveInfo, jobs: dict[int, Job]) -> Finding:
    src, dst = info.ranks
    send, recv = jobs.get(src), jobs.get(dst)
    assert send is not None and recv is not None
    api, step = send.api, send.step
    if send.api not in SENDS or recv.api not in RECVS:
        text = (f"rank {src} calls Distributed.{send.api} and rank {dst} calls Distributed.{recv.api}: a message "
                f"needs a send on rank {src} and a recv on rank {dst}, else the job hangs")
        return _mismatch(key, info, jobs, api, step, text, (src, dst))
    sent = _first_arg(send)
    received = flatten_outputs(recv.output)
    recv_c = recv.collective
    assert recv_c is not None and send.collective is not None
    if (not recv_c.unfinished and isinstance(sent, torch.Tensor) and len(received) == 1
            and isinstance(received[0], torch.Tensor) and (received[0].dtype != sent.dtype
                                                          or tuple(received[0].shape) != tuple(sent.shape))):
        text = (f"rank {src} sends {_tensor_text(sent)} with Distributed.{send.api} and rank {dst} receives into "
                f"{_tensor_text(received[0])} with Distributed.{recv.api}: a message received into a buffer of another "
                f"size or dtype makes the job hang or receive garbage")
        return _mismatch(key, info, jobs, api, step, text, (src, dst))
    verdicts: dict[int, RankVerdict] = {}
    notes, unfinished = [], []
    for job in (send, recv):
        c = job.collective
        if c is not None and c.unfinished:
            verdicts[job.rank] = _skip(job, _unfinished_why(job))
            notes.append(_unfinished_why(job))
            unfinished.append(job.rank)
    if src not in verdicts:
        verdicts[src] = RankVerdict(send, [], [], [], None, "a send has no output to compare")
    errors: list[int] = []
    if dst not in verdicts:
        if not isinstance(sent, torch.Tensor):
            verdicts[dst] = _skip(recv, f"{_where(info)}: the sender's record has no tensor to compare with")
        else:
            ex = _Exact([sent], [_rows([sent], [f"sent by rank {src}"])])
            diff = _first_difference(ex, received)
            if diff is None:
                verdicts[dst] = RankVerdict(recv, [_bench_of(sent)], [sent], [], None, "")
            else:
                msg = (f"Distributed.{recv.api} on rank {dst} received what rank {src} did not send: {diff}: a message "
                       "arrives bit-exact")
                verdicts[dst] = RankVerdict(recv, [_bench_of(sent)], [sent], [], ERROR, msg)
                notes.insert(0, msg)
                errors.append(dst)
    message = f"{_where(info)}: " + "; ".join(notes) if notes else ""
    return Finding(key, api, step, "unfinished" if unfinished else "matched", message, info.ranks,
                   tuple(sorted(set(errors) | set(unfinished))), verdicts)


# -- the matcher -------------------------------------------------------------------------------------------------

def _size(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} bytes"


def _nbytes(job: Job) -> int:
    if job.nbytes:
        return int(job.nbytes)
    return sum(t.numel() * t.element_size() for t in iter_leaves((job.args, job.kwargs, job.output))
               if isinstance(t, torch.Tensor))


class Matcher:
    """Thread-safe. Holds the records of collectives not yet complete, up to `budget` bytes (Job.nbytes)."""

    def __init__(self, budget: int = 1 << 30):
        self.budget = budget
        self._lock = threading.Lock()
        self._open: OrderedDict[Key, _Open] = OrderedDict()    # oldest first
        self._held = 0
        self._records = 0
        self._sent: dict[tuple[str, str, tuple[int, ...], int], SeqSet] = {}   # (job, group, ranks, rank): seqs
        self._ended: set[tuple[str, int]] = set()
        self._evicted: OrderedDict[Key, set[int]] = OrderedDict()   # evicted collectives: ranks still to come

    # -- public --------------------------------------------------------------------------------------------------
    def add(self, job: Job) -> list[Finding]:
        """The findings now decided (usually [] or [this collective's]); a repeated (key, rank) returns []."""
        try:
            return self._add(job)
        except Exception as exc:  # noqa: BLE001 - a record that cannot be matched must not stop the caller
            log.exception("internal error while matching %s", job.name)
            return [self._alone(job, "matched", f"internal error while matching: {type(exc).__name__}: {exc}")]

    def rank_ended(self, job_id: str, rank: int) -> list[Finding]:
        """Incomplete collectives of training `job_id` all of whose member ranks have ended: "missing"."""
        with self._lock:
            self._ended.add((job_id, int(rank)))
            done = [e for k, e in self._open.items() if k[0] == job_id and self._all_ended(k)]
            for e in done:
                self._drop(e)
        return [self._missing(e) for e in done]

    def finish(self) -> list[Finding]:
        """Every collective still incomplete, as "missing" (the server is done)."""
        with self._lock:
            done = list(self._open.values())
            for e in done:
                self._drop(e)
            self._evicted.clear()
        return [self._missing(e) for e in done]

    def pending(self) -> int:
        """Records held."""
        with self._lock:
            return self._records

    # -- internals -------------------------------------------------------------------------------------------------
    def _add(self, job: Job) -> list[Finding]:
        info = job.collective
        if info is None or job.api not in COLLECTIVES | POINT_TO_POINT:
            return [self._alone(job, "matched", f"{job.name} is not a collective record the server matches")]
        if job.rank not in info.ranks:
            return [self._alone(job, "matched", f"rank {job.rank} sent {_where(info)} it is not a member of")]
        key: Key = info.key
        findings: list[Finding] = []
        complete: _Open | None = None
        with self._lock:
            seen = self._sent.setdefault((info.job, info.group, info.ranks, job.rank), SeqSet())
            if not seen.add(info.seq):
                return []
            expected = self._evicted.get(key)
            if expected is not None:
                expected.discard(job.rank)
                if not expected:
                    del self._evicted[key]
                return [self._evicted_finding(key, {job.rank: job})]
            entry = self._open.get(key)
            if entry is None:
                entry = self._open[key] = _Open(key, {})
            entry.jobs[job.rank] = job
            size = _nbytes(job)
            entry.nbytes += size
            self._held += size
            self._records += 1
            if len(entry.jobs) == len(info.ranks):
                self._drop(entry)
                complete = entry
            evicted = []
            while self._held > self.budget and self._open:
                oldest = next(iter(self._open.values()))
                self._drop(oldest)
                self._evicted[oldest.key] = set(oldest.key[2]) - set(oldest.jobs)
                while len(self._evicted) > MAX_EVICTED:
                    self._evicted.popitem(last=False)
                evicted.append(oldest)
            missing = None
            if complete is None and key in self._open and self._all_ended(key):
                missing = self._open[key]
                self._drop(missing)
        findings += [self._evicted_finding(e.key, e.jobs) for e in evicted]
        if missing is not None:
            findings.append(self._missing(missing))
        if complete is not None:
            findings.append(_judge(key, complete.jobs))
        return findings

    def _drop(self, entry: _Open) -> None:
        """Under the lock: the entry is no longer held."""
        if self._open.pop(entry.key, None) is not None:
            self._held -= entry.nbytes
            self._records -= len(entry.jobs)

    def _all_ended(self, key: Key) -> bool:
        return all((key[0], r) in self._ended for r in key[2])

    def _alone(self, job: Job, kind: str, why: str) -> Finding:
        info = job.collective
        key: tuple[Any, ...] = info.key if info is not None else (job.run_id, "", (job.rank,), job.seq)
        ranks = info.ranks if info is not None else (job.rank,)
        return Finding(key, job.api, job.step, kind, why, ranks, (), {job.rank: _skip(job, why)})

    def _evicted_finding(self, key: Key, jobs: dict[int, Job]) -> Finding:
        first = _first_job(_info_of(key), jobs)
        info = first.collective or _info_of(key)
        why = (f"{_where(info)} not judged: the records of collectives waiting for their other ranks passed the "
               f"server's collective memory ({_size(self.budget)}); raise --collective-memory-mb")
        return Finding(key, first.api, first.step, "evicted", why, key[2], (),
                       {r: _skip(j, why) for r, j in jobs.items()})

    def _missing(self, entry: _Open) -> Finding:
        key, jobs = entry.key, entry.jobs
        first = _first_job(_info_of(key), jobs)
        info = first.collective or _info_of(key)
        missing = [r for r in key[2] if r not in jobs]
        if info.p2p:
            api = "recv" if key[2][1] in missing else "send"
            unit = ("message", f"messages from rank {key[2][0]} to rank {key[2][1]}")
        else:
            apis: dict[str, int] = {}
            for j in jobs.values():
                apis[j.api] = apis.get(j.api, 0) + 1
            api = max(apis, key=lambda a: apis[a])
            unit = ("collective", "collectives of this group")
        with self._lock:
            stops = []
            for r in missing:
                seen = self._sent.get((key[0], key[1], key[2], r))
                n = len(seen) if seen is not None else 0
                count = f"{n} {unit[1] if n != 1 else unit[1].replace(unit[0] + 's', unit[0], 1)}"
                stops.append(f"rank {r} ended after {count}" if (key[0], r) in self._ended
                             else f"rank {r} had sent {count} when the server finished")
        senders = sorted(jobs)
        sent = f"{'rank' if len(senders) == 1 else 'ranks'} {', '.join(map(str, senders))} sent it"
        message = f"{_where(info)}: {_who(missing)} never called Distributed.{api} ({sent}; {', '.join(stops)})"
        return Finding(key, first.api if info.p2p else api, first.step, "missing", message, key[2], tuple(missing),
                       {r: _skip(j, message) for r, j in jobs.items()})
