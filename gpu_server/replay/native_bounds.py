"""Index arguments that native kernels dereference, checked against what they index (docs/security.md, "What the
server replays").

Many allowlisted kernels take integer tensors whose values are positions in another tensor: `gather`'s `index`,
`embedding`'s `indices`, `max_pool2d_with_indices_backward`'s `indices`, `ctc_loss`'s `targets` and lengths,
`segment_reduce`'s `lengths`/`offsets`, LU pivots, ... Some CPU kernels check them, others do not (an index of 2**40
to `max_pool2d_with_indices_backward` is a SIGSEGV, one of 100,000 a silent write past a heap buffer), and CUDA
kernels answer a bad index with a device-side assert that leaves the process's CUDA context unusable. So every such
argument is checked here, by value, before anything is called: the record is not replayable, with a reason naming
the argument, its bad value and the bound.

`index_problem(category, api, args, kwargs)` is a plain function of the decoded arguments: the intake calls it
through `gpu_server.replay.registry.replayable` before a record is acknowledged, and `gpu_server.replay.run` calls it
again
before each replay (a worker process that decodes a spooled record meets the same check). It fails closed: a check
that cannot make sense of the arguments refuses the call rather than letting the kernel see them.

`RULES` is the table: for each API name, the namespaces it applies to, the parameter names in positional order and
the check. tests/test_native_bounds.py walks the allowlist and torch's operator schemas and fails when an
allowlisted API takes an index-like argument that has no rule here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

_AT = ("Torch", "Tensor", "Aten")     # torch.X(input, ...), Tensor.X(self, ...), aten::X(self, ...): one order
_F = ("Functional",)


class _Refuse(Exception):
    """A check's verdict: the call is not replayable, str() says why."""


class Args:
    """A call's arguments by parameter name (positional order from the rule, keywords by name)."""

    def __init__(self, params: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.values: dict[str, Any] = dict(zip(params, args))
        for name, value in kwargs.items():
            self.values.setdefault(name, value)

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def tensor(self, name: str) -> torch.Tensor | None:
        value = self.values.get(name)
        return value if isinstance(value, torch.Tensor) else None


Check = Callable[[Args], None]


@dataclasses.dataclass(frozen=True)
class Rule:
    categories: tuple[str, ...]
    params: tuple[str, ...]
    check: Check
    what: str            # which arguments are checked, for the docs and the report


RULES: dict[str, list[Rule]] = {}


def _rule(categories: tuple[str, ...], names: str, params: str, what: str) -> Callable[[Check], Check]:
    def register(check: Check) -> Check:
        for name in names.split():
            RULES.setdefault(name, []).append(Rule(categories, tuple(params.split()), check, what))
        return check
    return register


def index_problem(category: str, api: str, args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None) -> str | None:
    """None when every index-like argument of `Category.api(*args, **kwargs)` lies within what it indexes, else the
    reason the call is not replayable ("not replayable: ...")."""
    rules = [r for r in RULES.get(api, ()) if category in r.categories]
    if not rules:
        return None
    for rule in rules:
        try:
            rule.check(Args(rule.params, args, kwargs or {}))
        except _Refuse as exc:
            return f"not replayable: {category}.{api}: {exc}"
        except Exception as exc:  # noqa: BLE001 - fail closed: arguments the check cannot read never reach the kernel
            return (f"not replayable: {category}.{api}: its index arguments could not be checked "
                    f"({type(exc).__name__}: {str(exc)[:120]})")
    return None


# -- helpers ---------------------------------------------------------------------------------------------------------
_CONSEQUENCE = "the native kernel would read or write outside the tensor"


def _integer(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _as_index(value: Any) -> torch.Tensor | None:
    """An integer tensor, or a (nested) sequence of ints as the tensor torch makes of it; None for anything else."""
    if isinstance(value, torch.Tensor):
        return value if _integer(value) else None
    if isinstance(value, (list, tuple)) and value:
        try:
            t = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return None
        return t if _integer(t) else None
    return None


def _extremes(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 1:
        v = int(t.reshape(()).item())
        return v, v
    lo, hi = torch.aminmax(t.reshape(-1))
    return int(lo), int(hi)


def _within(name: str, t: torch.Tensor | None, lo: int, hi: int, bound: str, ignore: int | None = None) -> None:
    """Every value of the integer tensor `t` lies in [lo, hi) (values equal to `ignore` aside)."""
    if t is None or not _integer(t) or t.numel() == 0:
        return
    if ignore is not None:
        t = t[t != ignore]
        if t.numel() == 0:
            return
    small, large = _extremes(t)
    if small < lo or large >= hi:
        bad = small if small < lo else large
        raise _Refuse(f"argument '{name}' holds {bad}, outside [{lo}, {hi}) ({bound}); {_CONSEQUENCE}")


def _dim(t: torch.Tensor, dim: Any) -> int | None:
    """`dim` wrapped for `t`, or None when it is not a valid dimension (torch refuses the call itself then)."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    n = max(t.dim(), 1)
    if not -n <= dim < n:
        return None
    return dim % n


def _size(t: torch.Tensor, dim: int) -> int:
    return t.shape[dim] if t.dim() > 0 else 1


def _int_values(value: Any) -> torch.Tensor | None:
    """A lengths argument given as a tensor, an int or a sequence of ints, as a 1-D int64 tensor."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return torch.tensor([value])
    if isinstance(value, torch.Tensor):
        return value.reshape(-1) if _integer(value) else None
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return torch.tensor(value, dtype=torch.int64)
    return None


# -- gather / scatter / index_* / take / put -------------------------------------------------------------------------
def _along_dim(a: Args, index: str, negative: bool) -> None:
    self, dim = a.tensor("self"), a.get("dim")
    t = a.tensor(index)
    if self is None or t is None:
        return
    d = _dim(self, dim)
    if d is None:
        return
    n = _size(self, d)
    _within(index, t, -n if negative else 0, n, f"dimension {dim} of 'self' has {n} entries")


@_rule(_AT, "gather", "self dim index", "index within self.size(dim)")
def _gather(a: Args) -> None:
    _along_dim(a, "index", negative=False)


@_rule(_AT, "scatter scatter_ scatter_add scatter_add_ scatter_reduce scatter_reduce_", "self dim index src",
       "index within self.size(dim)")
def _scatter(a: Args) -> None:
    _along_dim(a, "index", negative=False)


@_rule(_AT, "index_select", "self dim index", "index within self.size(dim)")
def _index_select(a: Args) -> None:
    _along_dim(a, "index", negative=False)


@_rule(_AT, "index_add index_add_ index_copy index_copy_ index_reduce index_reduce_", "self dim index source",
       "index within self.size(dim)")
def _index_source(a: Args) -> None:
    _along_dim(a, "index", negative=False)


@_rule(_AT, "index_fill index_fill_", "self dim index value", "index within [-self.size(dim), self.size(dim))")
def _index_fill(a: Args) -> None:
    _along_dim(a, "index", negative=True)


@_rule(_AT, "take", "self index", "index within [-self.numel(), self.numel())")
def _take(a: Args) -> None:
    self = a.tensor("self")
    if self is not None:
        n = self.numel()
        _within("index", a.tensor("index"), -n, n, f"'self' has {n} elements")


@_rule(_AT, "put put_", "self index source accumulate", "index within [-self.numel(), self.numel())")
def _put(a: Args) -> None:
    _take(a)


@_rule(_AT, "take_along_dim", "self indices dim", "indices within [-size, size) of the dimension they index")
def _take_along_dim(a: Args) -> None:
    self, t, dim = a.tensor("self"), a.tensor("indices"), a.get("dim")
    if self is None or t is None:
        return
    if dim is None:
        n = self.numel()
        _within("indices", t, -n, n, f"'self' has {n} elements")
        return
    d = _dim(self, dim)
    if d is not None:
        n = _size(self, d)
        _within("indices", t, -n, n, f"dimension {dim} of 'self' has {n} entries")


# -- advanced indexing -----------------------------------------------------------------------------------------------
def _index_items(index: Any) -> list[Any]:
    """The entries of an indexing expression as Python's indexing reads them (`x[i]`, `x[i, j]`, `x[[0, 1]]`)."""
    if isinstance(index, tuple):
        return list(index)
    if isinstance(index, list) and any(isinstance(v, (torch.Tensor, slice, list, tuple)) or v is None or v is Ellipsis
                                       for v in index):
        return list(index)   # a list holding slices, None, ... or sequences is read as a tuple
    return [index]


def _consumed(item: Any) -> int:
    if item is None or item is Ellipsis or isinstance(item, bool):
        return 0
    if isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8):
        return max(item.dim(), 1)
    if isinstance(item, (list, tuple)):
        t = _as_mask_or_index(item)
        if t is not None and t.dtype == torch.bool:
            return max(t.dim(), 1)
    return 1


def _as_mask_or_index(value: Any) -> torch.Tensor | None:
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return t if t.dtype == torch.bool or _integer(t) else None


def _advanced(self: torch.Tensor, items: list[Any], name: str, positional: bool) -> None:
    """Each integer tensor (or sequence of ints) indexing dimension p of `self` holds values in [-size, size).
    `positional`: the entries stand for dimensions 0, 1, ... one each (aten's index_put `indices`, None = all);
    else they are Python indexing entries (None and bools add a dimension, `...` spans the rest)."""
    p = 0
    rest = self.dim() - sum(_consumed(i) for i in items)
    for k, item in enumerate(items):
        if p >= self.dim():
            return   # more indices than dimensions: torch refuses the call itself
        where = f"{name}[{k}]" if len(items) > 1 or positional else name
        if positional and item is None:
            p += 1
            continue
        if item is None or isinstance(item, bool):
            continue
        if item is Ellipsis:
            p += max(rest, 0)
            continue
        t = _as_index(item) if not isinstance(item, torch.Tensor) else item
        if isinstance(item, (list, tuple)) and t is None:
            mask = _as_mask_or_index(item)
            if mask is not None and mask.dtype == torch.bool:
                p += max(mask.dim(), 1)
                continue
        if t is not None and _integer(t) and t.dtype != torch.uint8:
            n = self.shape[p]
            _within(where, t, -n, n, f"dimension {p} of 'self' has {n} entries")
        p += _consumed(item)


@_rule(("Tensor",), "__getitem__", "self indices", "integer index tensors within the dimension they index")
def _getitem(a: Args) -> None:
    self = a.tensor("self")
    if self is not None and "indices" in a.values:
        _advanced(self, _index_items(a.get("indices")), "indices", positional=False)


@_rule(("Tensor",), "__setitem__", "self indices value", "integer index tensors within the dimension they index")
def _setitem(a: Args) -> None:
    _getitem(a)


@_rule(_AT, "index_put index_put_", "self indices values accumulate",
       "integer index tensors within the dimension they index")
def _index_put(a: Args) -> None:
    self, indices = a.tensor("self"), a.get("indices")
    if self is not None and isinstance(indices, (list, tuple)):
        _advanced(self, list(indices), "indices", positional=True)


# -- embeddings ------------------------------------------------------------------------------------------------------
def _rows(name: str, t: torch.Tensor | None, rows: int, of: str) -> None:
    _within(name, t, 0, rows, f"{of} has {rows} rows")


@_rule(_AT, "embedding", "weight indices padding_idx scale_grad_by_freq sparse", "indices within weight.size(0)")
def _embedding(a: Args) -> None:
    w = a.tensor("weight")
    if w is not None and w.dim() > 0:
        _rows("indices", a.tensor("indices"), w.shape[0], "'weight'")


@_rule(_F, "embedding", "input weight padding_idx max_norm norm_type scale_grad_by_freq sparse",
       "input within weight.size(0) (max_norm renormalises those rows in place)")
def _f_embedding(a: Args) -> None:
    w = a.tensor("weight")
    if w is not None and w.dim() > 0:
        _rows("input", a.tensor("input"), w.shape[0], "'weight'")


@_rule(("Torch",), "embedding_renorm_", "self indices max_norm norm_type", "indices within self.size(0)")
def _embedding_renorm(a: Args) -> None:
    w = a.tensor("self")
    if w is not None and w.dim() > 0:
        _rows("indices", a.tensor("indices"), w.shape[0], "'self'")


@_rule(("Aten",), "embedding_backward", "grad indices num_weights padding_idx scale_grad_by_freq sparse",
       "indices within num_weights")
def _embedding_backward(a: Args) -> None:
    n = a.get("num_weights")
    if isinstance(n, int) and not isinstance(n, bool):
        _within("indices", a.tensor("indices"), 0, max(n, 0), f"num_weights is {n}")


@_rule(("Aten",), "embedding_dense_backward", "grad_output indices num_weights padding_idx scale_grad_by_freq",
       "indices within num_weights")
def _embedding_dense_backward(a: Args) -> None:
    _embedding_backward(a)


def _bag(a: Args, indices_name: str) -> None:
    w, idx, offsets = a.tensor("weight"), a.tensor(indices_name), a.tensor("offsets")
    if w is None or idx is None or w.dim() == 0:
        return
    _rows(indices_name, idx, w.shape[0], "'weight'")
    if offsets is None or not _integer(offsets) or idx.dim() != 1:
        return
    o = offsets.reshape(-1)
    if o.numel() == 0:
        return
    n = idx.numel()
    first = int(o[0])
    if first != 0:
        raise _Refuse(f"argument 'offsets' starts at {first}, not 0; {_CONSEQUENCE}")
    _within("offsets", o, 0, n + 1, f"'{indices_name}' has {n} elements, so an offset lies in [0, {n}]")
    if o.numel() > 1 and bool((o[1:] < o[:-1]).any()):
        raise _Refuse(f"argument 'offsets' decreases (bags must not overlap or run backwards); {_CONSEQUENCE}")


@_rule(_AT, "embedding_bag", "weight indices offsets scale_grad_by_freq mode sparse per_sample_weights "
       "include_last_offset padding_idx", "indices within weight.size(0); offsets from 0, non-decreasing, within "
       "indices")
def _embedding_bag(a: Args) -> None:
    _bag(a, "indices")


@_rule(_F, "embedding_bag", "input weight offsets max_norm norm_type scale_grad_by_freq mode sparse "
       "per_sample_weights include_last_offset padding_idx",
       "input within weight.size(0); offsets from 0, non-decreasing, within input")
def _f_embedding_bag(a: Args) -> None:
    _bag(a, "input")


# -- pooling ---------------------------------------------------------------------------------------------------------
@_rule(("Aten",), "max_pool2d_with_indices_backward",
       "grad_output self kernel_size stride padding dilation ceil_mode indices",
       "indices within the H*W positions of self's planes")
def _max_pool2d_backward(a: Args) -> None:
    self = a.tensor("self")
    if self is not None and self.dim() >= 2:
        plane = self.shape[-2] * self.shape[-1]
        _within("indices", a.tensor("indices"), 0, plane,
                f"a plane of 'self' ({self.shape[-2]}x{self.shape[-1]}) has {plane} positions")


def _tuple(value: Any, n: int) -> tuple[int, ...] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * n
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if len(value) == 1:
            return (value[0],) * n
        return tuple(value[-n:]) if len(value) >= n else None
    return None


def _unpool(a: Args, n: int) -> None:
    x, idx = a.tensor("input"), a.tensor("indices")
    if x is None or idx is None or x.dim() < n:
        return
    out = _tuple(a.get("output_size"), n) if a.get("output_size") is not None else None
    if out is None:
        kernel = _tuple(a.get("kernel_size"), n)
        stride = _tuple(a.get("stride"), n) if a.get("stride") is not None else kernel
        padding = _tuple(a.get("padding", 0), n)
        if kernel is None or stride is None or padding is None:
            return
        out = tuple((x.shape[x.dim() - n + i] - 1) * stride[i] - 2 * padding[i] + kernel[i] for i in range(n))
    plane = math.prod(out)
    _within("indices", idx, 0, max(plane, 0), f"the output planes ({'x'.join(map(str, out))}) have {plane} positions")


@_rule(_F, "max_unpool1d", "input indices kernel_size stride padding output_size", "indices within the output plane")
def _unpool1d(a: Args) -> None:
    _unpool(a, 1)


@_rule(_F, "max_unpool2d", "input indices kernel_size stride padding output_size", "indices within the output plane")
def _unpool2d(a: Args) -> None:
    _unpool(a, 2)


@_rule(_F, "max_unpool3d", "input indices kernel_size stride padding output_size", "indices within the output volume")
def _unpool3d(a: Args) -> None:
    _unpool(a, 3)


# -- losses with class indices ---------------------------------------------------------------------------------------
def _classes(x: torch.Tensor) -> int:
    return x.shape[1] if x.dim() >= 2 else (x.shape[0] if x.dim() == 1 else 1)


def _nll(a: Args, input_name: str) -> None:
    x, target = a.tensor(input_name), a.tensor("target")
    if x is None or target is None or not _integer(target):
        return   # class probabilities (a floating target) index nothing
    ignore = a.get("ignore_index", -100)
    c = _classes(x)
    _within("target", target, 0, c, f"'{input_name}' has {c} classes; ignore_index={ignore} aside",
            ignore=ignore if isinstance(ignore, int) else -100)   # None means -100 (torch's own default)


@_rule(("Aten",), "nll_loss nll_loss_forward nll_loss2d_forward", "self target weight reduction ignore_index",
       "target within the classes of self, or ignore_index")
def _aten_nll(a: Args) -> None:
    _nll(a, "self")


@_rule(("Aten",), "cross_entropy_loss", "self target weight reduction ignore_index label_smoothing",
       "target within the classes of self, or ignore_index")
def _aten_cross_entropy(a: Args) -> None:
    _nll(a, "self")


@_rule(("Aten",), "nll_loss_backward nll_loss2d_backward",
       "grad_output self target weight reduction ignore_index total_weight",
       "target within the classes of self, or ignore_index")
def _aten_nll_backward(a: Args) -> None:
    _nll(a, "self")


@_rule(_F, "nll_loss", "input target weight size_average ignore_index reduce reduction",
       "target within the classes of input, or ignore_index")
def _f_nll(a: Args) -> None:
    _nll(a, "input")


@_rule(_F, "cross_entropy", "input target weight size_average ignore_index reduce reduction label_smoothing",
       "target (class indices) within the classes of input, or ignore_index")
def _f_cross_entropy(a: Args) -> None:
    _nll(a, "input")


@_rule(_F, "linear_cross_entropy", "input linear_weight target",
       "target within the rows of linear_weight, or ignore_index")
def _f_linear_cross_entropy(a: Args) -> None:
    w, target = a.tensor("linear_weight"), a.tensor("target")
    if w is None or target is None or not _integer(target) or w.dim() == 0:
        return
    ignore = a.get("ignore_index")
    _within("target", target, 0, w.shape[0], f"'linear_weight' has {w.shape[0]} classes",
            ignore=ignore if isinstance(ignore, int) else -100)   # None means -100 (torch's own default)


@_rule(_F, "multi_margin_loss", "input target p margin weight size_average reduce reduction",
       "target within input.size(-1)")
def _f_multi_margin(a: Args) -> None:
    x = a.tensor("input")
    if x is not None and x.dim() > 0:
        _within("target", a.tensor("target"), 0, x.shape[-1], f"'input' has {x.shape[-1]} classes")


@_rule(_F, "multilabel_margin_loss", "input target size_average reduce reduction",
       "target within [-1, input.size(-1))")
def _f_multilabel_margin(a: Args) -> None:
    x = a.tensor("input")
    if x is not None and x.dim() > 0:
        _within("target", a.tensor("target"), -1, x.shape[-1], f"'input' has {x.shape[-1]} classes, -1 ends a row")


def _ctc(a: Args) -> None:
    lp, targets = a.tensor("log_probs"), a.tensor("targets")
    if lp is None or targets is None or lp.dim() not in (2, 3):
        return
    t_len, classes = lp.shape[0], lp.shape[-1]
    batch = lp.shape[1] if lp.dim() == 3 else 1
    blank = a.get("blank", 0)
    if isinstance(blank, int) and not isinstance(blank, bool) and not 0 <= blank < classes:
        raise _Refuse(f"argument 'blank' is {blank}, outside [0, {classes}) (the classes of 'log_probs'); "
                      f"{_CONSEQUENCE}")
    inputs, lengths = _int_values(a.get("input_lengths")), _int_values(a.get("target_lengths"))
    if inputs is None or lengths is None:
        raise _Refuse("input_lengths and target_lengths must be integers, sequences of integers or integer tensors")
    if inputs.numel() != batch or lengths.numel() != batch:
        raise _Refuse(f"input_lengths has {inputs.numel()} and target_lengths {lengths.numel()} entries for a batch "
                      f"of {batch}; {_CONSEQUENCE}")
    _within("input_lengths", inputs, 0, t_len + 1, f"'log_probs' has {t_len} time steps")
    if not _integer(targets):
        return
    if targets.dim() == 2 or (lp.dim() == 2 and targets.dim() == 1):   # padded (N, S), or one unbatched sequence
        s = targets.shape[-1]
        _within("target_lengths", lengths, 0, s + 1, f"'targets' holds {s} labels per sequence")
        rows = targets.reshape(batch, s)
        used = rows[torch.arange(s).unsqueeze(0) < lengths.unsqueeze(1)]
    elif targets.dim() == 1:                                            # concatenated
        _within("target_lengths", lengths, 0, targets.numel() + 1, f"'targets' holds {targets.numel()} labels")
        total = int(lengths.sum())
        if total > targets.numel():
            raise _Refuse(f"argument 'target_lengths' adds up to {total}, more than the {targets.numel()} labels of "
                          f"'targets'; {_CONSEQUENCE}")
        used = targets[:total]
    else:
        return
    _within("targets", used, 0, classes, f"'log_probs' has {classes} classes")


@_rule(_AT, "ctc_loss", "log_probs targets input_lengths target_lengths blank reduction zero_infinity",
       "targets within the classes, lengths within log_probs and targets, blank a class")
def _ctc_loss(a: Args) -> None:
    _ctc(a)


@_rule(_F, "ctc_loss", "log_probs targets input_lengths target_lengths blank reduction zero_infinity",
       "targets within the classes, lengths within log_probs and targets, blank a class")
def _f_ctc_loss(a: Args) -> None:
    _ctc(a)


# -- segments, sorting, repeats, counts ------------------------------------------------------------------------------
@_rule(_AT, "segment_reduce", "data reduce", "lengths >= 0 adding up to data.size(axis) per row; offsets from >= 0, "
       "non-decreasing, within data.size(axis) (whatever `unsafe` says)")
def _segment_reduce(a: Args) -> None:
    """torch checks lengths only when unsafe=False and offsets not at all (an offset of 2**40 is a SIGSEGV): both are
    checked here in full, so `unsafe=True` only skips torch's own copy of these checks."""
    data = a.tensor("data")
    if data is None:
        return
    if a.get("indices") is not None:
        raise _Refuse("segment_reduce with indices= is not supported by torch")
    axis = _dim(data, a.get("axis", 0))
    if axis is None:
        return
    size = _size(data, axis)
    lengths, offsets = a.get("lengths"), a.get("offsets")
    for name, t in (("lengths", lengths), ("offsets", offsets)):
        if t is None:
            continue
        if not _integer(t) or t.dim() != axis + 1 or tuple(t.shape[:-1]) != tuple(data.shape[:axis]):
            raise _Refuse(f"argument '{name}' must be an integer tensor shaped like data's dimensions before axis "
                          f"{axis} plus one, got {getattr(t, 'dtype', type(t).__name__)} "
                          f"{list(getattr(t, 'shape', []))}")
    if isinstance(lengths, torch.Tensor):
        _within("lengths", lengths, 0, size + 1, f"dimension {axis} of 'data' has {size} entries")
        sums = lengths.sum(dim=-1)
        if lengths.numel() and bool((sums != size).any()):
            bad = int(sums[sums != size].reshape(-1)[0])
            raise _Refuse(f"argument 'lengths' adds up to {bad}, not the {size} entries of dimension {axis} of 'data'; "
                          f"{_CONSEQUENCE}")
    if isinstance(offsets, torch.Tensor):
        _within("offsets", offsets, 0, size + 1, f"dimension {axis} of 'data' has {size} entries")
        if offsets.shape[-1] > 1 and bool((offsets[..., 1:] < offsets[..., :-1]).any()):
            raise _Refuse(f"argument 'offsets' decreases; {_CONSEQUENCE}")


@_rule(_AT, "searchsorted", "sorted_sequence self", "sorter within sorted_sequence.size(-1)")
def _searchsorted(a: Args) -> None:
    seq = a.tensor("sorted_sequence")
    if seq is not None and seq.dim() > 0:
        n = seq.shape[-1]
        _within("sorter", a.tensor("sorter"), 0, n, f"'sorted_sequence' has {n} entries in its last dimension")


@_rule(_AT, "repeat_interleave", "self repeats dim", "repeats >= 0; output_size equal to the repeated size")
def _repeat_interleave(a: Args) -> None:
    self, repeats = a.get("self"), a.get("repeats")
    if repeats is None and isinstance(self, torch.Tensor):   # repeat_interleave(repeats): the tensor is the repeats
        self, repeats = None, self
    r = _as_index(repeats) if not isinstance(repeats, int) else torch.tensor([repeats])
    if r is None:
        return
    _within("repeats", r, 0, 1 << 62, "a repeat count is not negative")
    size = a.get("output_size")
    if size is None:
        return
    total = int(r.sum())
    if isinstance(self, torch.Tensor) and r.numel() == 1:
        d = _dim(self, a.get("dim")) if a.get("dim") is not None else None
        total *= _size(self, d) if d is not None else self.numel()
    if size != total:
        raise _Refuse(f"argument 'output_size' is {size}, but the repeats add up to {total}; {_CONSEQUENCE}")


@_rule(_AT, "bincount", "self weights minlength", "values >= 0")
def _bincount(a: Args) -> None:
    _within("self", a.tensor("self"), 0, 1 << 62, "bincount counts non-negative values")


@_rule(_F, "one_hot", "tensor num_classes", "values within [0, num_classes)")
def _one_hot(a: Args) -> None:
    n = a.get("num_classes", -1)
    top = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1 << 62
    _within("tensor", a.tensor("tensor"), 0, top, f"num_classes is {n}")


@_rule(("Aten",), "one_hot", "self num_classes", "values within [0, num_classes)")
def _aten_one_hot(a: Args) -> None:
    n = a.get("num_classes", -1)
    top = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1 << 62
    _within("self", a.tensor("self"), 0, top, f"num_classes is {n}")


@_rule(_AT, "masked_scatter masked_scatter_", "self mask source", "source holds a value for every True of mask")
def _masked_scatter(a: Args) -> None:
    self, mask, source = a.tensor("self"), a.tensor("mask"), a.tensor("source")
    if self is None or mask is None or source is None or mask.dtype != torch.bool or mask.numel() == 0:
        return
    try:
        shape = torch.broadcast_shapes(self.shape, mask.shape)
    except RuntimeError:
        return   # torch refuses the shapes itself
    wanted = int(mask.count_nonzero()) * (math.prod(shape) // mask.numel())
    if wanted > source.numel():
        raise _Refuse(f"argument 'mask' selects {wanted} positions but 'source' holds {source.numel()} values; "
                      f"{_CONSEQUENCE}")


# -- recurrent networks over packed sequences ------------------------------------------------------------------------
@_rule(_AT, "lstm gru rnn_tanh rnn_relu", "data batch_sizes hx params",
       "packed batch_sizes: positive, non-increasing, adding up to data.size(0), at most the batch of hx")
def _packed(a: Args) -> None:
    data, sizes = a.tensor("data"), a.get("batch_sizes")
    if data is None or not isinstance(a.get("params"), (list, tuple)):
        return   # the padded overload: lstm(input, hx, params, has_biases, ...), its fourth argument a bool
    if not isinstance(sizes, torch.Tensor):
        raise _Refuse("argument 'batch_sizes' of a packed sequence must be a tensor")
    if not _integer(sizes) or sizes.dim() != 1:
        raise _Refuse("argument 'batch_sizes' must be a 1-D integer tensor")
    hx = a.get("hx")
    h0 = hx[0] if isinstance(hx, (list, tuple)) and hx else hx
    batch = h0.shape[1] if isinstance(h0, torch.Tensor) and h0.dim() == 3 else None
    _within("batch_sizes", sizes, 1, (batch if batch is not None else 1 << 62) + 1,
            f"the hidden state holds a batch of {batch}" if batch is not None else "a batch is at least 1")
    if sizes.numel() > 1 and bool((sizes[1:] > sizes[:-1]).any()):
        raise _Refuse(f"argument 'batch_sizes' increases (a packed sequence's batches shrink); {_CONSEQUENCE}")
    rows = data.shape[0] if data.dim() > 0 else 0
    if int(sizes.sum()) != rows:
        raise _Refuse(f"argument 'batch_sizes' adds up to {int(sizes.sum())}, not the {rows} rows of 'data'; "
                      f"{_CONSEQUENCE}")


# -- LAPACK pivots ---------------------------------------------------------------------------------------------------
def _pivots(name: str, pivots: torch.Tensor | None, factor: torch.Tensor | None, of: str, signed: bool) -> None:
    if pivots is None or factor is None or factor.dim() < 2:
        return
    n = factor.shape[-2]
    if signed:   # LDL: a negative pivot -p names row p of a 2x2 block
        _within(name, pivots.abs() if _integer(pivots) else None, 1, n + 1, f"'{of}' has {n} rows (|pivot|)")
    else:
        _within(name, pivots, 1, n + 1, f"'{of}' has {n} rows, pivots count from 1")


@_rule(_AT, "linalg_lu_solve", "LU pivots B", "pivots within [1, LU.size(-2)]")
def _lu_solve(a: Args) -> None:
    _pivots("pivots", a.tensor("pivots"), a.tensor("LU"), "LU", signed=False)


@_rule(_AT, "lu_solve", "self LU_data LU_pivots", "LU_pivots within [1, LU_data.size(-2)]")
def _old_lu_solve(a: Args) -> None:
    _pivots("LU_pivots", a.tensor("LU_pivots"), a.tensor("LU_data"), "LU_data", signed=False)


@_rule(_AT, "lu_unpack", "LU_data LU_pivots unpack_data unpack_pivots", "LU_pivots within [1, LU_data.size(-2)]")
def _lu_unpack(a: Args) -> None:
    _old_lu_solve(a)


@_rule(_AT, "linalg_ldl_solve", "LD pivots B", "|pivots| within [1, LD.size(-2)]")
def _ldl_solve(a: Args) -> None:
    _pivots("pivots", a.tensor("pivots"), a.tensor("LD"), "LD", signed=True)


# -- grouped matrix products -----------------------------------------------------------------------------------------
@_rule(_F, "grouped_mm", "mat_a mat_b", "offs non-decreasing within the grouped dimension, one per group")
def _grouped_mm(a: Args) -> None:
    ma, mb, offs = a.tensor("mat_a"), a.tensor("mat_b"), a.tensor("offs")
    if ma is None or mb is None or offs is None or not _integer(offs):
        return
    if ma.dim() not in (2, 3) or mb.dim() not in (2, 3):
        return
    if ma.dim() == 2 and mb.dim() == 2:
        size, of, groups = ma.shape[1], "the shared dimension of 'mat_a' and 'mat_b'", None
    elif ma.dim() == 2:
        size, of, groups = ma.shape[0], "the rows of 'mat_a'", mb.shape[0]
    elif mb.dim() == 2:
        size, of, groups = mb.shape[-1], "the columns of 'mat_b'", ma.shape[0]
    else:
        return
    o = offs.reshape(-1)
    if groups is not None and o.numel() != groups:
        raise _Refuse(f"argument 'offs' has {o.numel()} entries for {groups} groups; {_CONSEQUENCE}")
    _within("offs", o, 0, size + 1, f"{of} has {size} entries")
    if o.numel() > 1 and bool((o[1:] < o[:-1]).any()):
        raise _Refuse(f"argument 'offs' decreases; {_CONSEQUENCE}")
