"""What a replay allocates that the meta-device dry run cannot see (docs/security.md, "What the server replays").

`gpu_server.replay.run.allocation_check` runs each call once on the meta device (shapes only) and refuses one whose
outputs would be far larger than the device's. This module covers what that dry run misses:

- **Sizes given as tensors.** `zeros(tensor(N))`, `x.repeat(tensor(N), 1)`, `x.new_zeros((tensor(N),))`: a meta
  tensor has no value, so the dry run fails. `scalar_arguments` turns every one-element tensor (except a method's
  own `self`) into the Python number it holds for a second dry run, so the bound applies to the size it names.
- **Boolean masks in indexing.** `x[mask]`, `x[mask] = v`, `index_put(x, (mask,), v)`: `mask_arguments` replaces
  each mask by the positions it selects (`nonzero`, computed on the real mask: its size is bounded by the mask's).
- **Outputs whose size depends on values** (`OUTPUT_ESTIMATES`: `bincount`, `one_hot`, `repeat_interleave`,
  `combinations`, `masked_select`, `histogram`, `cov`, `binomial`, ...): `output_elements` computes the size from the
  values, and the same bound as for a dry run applies to it.
- **APIs whose dry run fails for good reason** (no meta kernel or a data-dependent shape) but whose memory is bounded
  by their inputs (`BOUNDED_BY_INPUTS`): a failing dry run is accepted for these names only; for every other API it
  makes the call not replayable.
- **Intermediates** far larger than the outputs (`intermediate_bytes`): the float64 im2col buffer of a convolution
  on a CPU bench, `mvlgamma`'s (..., p) table, `ctc_loss`'s alpha/beta tables, `combinations`' n**r masks,
  `einsum`'s left-to-right products, the score matrix of `npu_fusion_attention`'s reference and of a
  `scaled_dot_product_attention` replayed with a recovered dropout mask, the broadcast of `allclose`. The allowance is
  `INTERMEDIATE_FACTOR` times the record's elements at 8 bytes each, plus `INTERMEDIATE_SLACK_BYTES`: a large
  record may need large buffers, a small one cannot ask for gigabytes.

Every function here is a plain function of a call's category, name and decoded arguments; none allocates more than
its arguments (each scans them once).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from protos.trees import iter_leaves, map_leaves

ELEMENT_BYTES = 8                   # the bench computes in float64 (or int64) at most
INTERMEDIATE_FACTOR = 64            # an intermediate may hold 64x the elements the record carries ...
INTERMEDIATE_SLACK_BYTES = 256 << 20   # ... plus 256 MiB, whatever the record

_BIG = 1 << 62   # "more than anything the host has"; estimates are capped here instead of growing without bound


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# A failing meta dry run is accepted for these names only: their outputs and workspaces are bounded by the sizes of
# their inputs (a selection, a sort, a LAPACK factorisation, a copy, a view, a packed recurrent pass, a loss, an
# optimizer step that updates its arguments in place; gaussian_nll_loss and the reference of the NPU's fused
# attention check values with `.item()`/`torch.equal`, which meta tensors cannot answer). Their large
# intermediates, where they have any, are estimated below (ctc_loss, gaussian_nll_loss, npu_fusion_attention).
BOUNDED_BY_INPUTS = _names("""
nonzero argwhere where unique unique_consecutive equal geqrf linalg_lstsq cpu cuda tensor_split
lstm gru rnn_tanh rnn_relu ctc_loss gaussian_nll_loss _fused_sgd_ _fused_adagrad_ npu_fusion_attention
""")

_INDEXING = _names("__getitem__ __setitem__ index_put index_put_")


# -- argument transforms for the dry run -----------------------------------------------------------------------------
Arguments = tuple[tuple[Any, ...], dict[str, Any]]


def scalar_arguments(category: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Arguments:
    """The arguments with each one-element tensor replaced by the number it holds, except a Tensor method's `self`:
    what a size given as a tensor names (`zeros(tensor(N))`, `x.repeat(tensor(N), 1)`), for a second dry run."""
    def number(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.numel() == 1 and not leaf.is_complex():
            return leaf.reshape(()).item()
        return leaf

    if category == "Tensor" and args:
        return (args[0],) + tuple(map_leaves(args[1:], number)), map_leaves(kwargs, number)
    return tuple(map_leaves(args, number)), map_leaves(kwargs, number)


def has_masks(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return api in _INDEXING and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                                    for t in iter_leaves((args[1:], kwargs)))


def mask_arguments(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Arguments:
    """Indexing arguments with each boolean mask replaced by the integer positions it selects (the same indexing;
    the dry run can then compute the shape)."""
    if not has_masks(api, args, kwargs) or len(args) < 2:
        return args, kwargs

    def expand(index: Any) -> Any:
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            return index.nonzero(as_tuple=True) if index.dim() else index
        if isinstance(index, (tuple, list)):
            out: list[Any] = []
            for item in index:
                if isinstance(item, torch.Tensor) and item.dtype == torch.bool and item.dim():
                    out.extend(item.nonzero(as_tuple=True))
                else:
                    out.append(item)
            return tuple(out) if isinstance(index, tuple) or api in ("index_put", "index_put_") else out
        return index

    return (args[0], expand(args[1])) + tuple(args[2:]), kwargs


# -- outputs whose size depends on values ----------------------------------------------------------------------------
def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.reshape(()).item())
    return None


def _maximum(t: torch.Tensor) -> int:
    return int(t.max()) if t.numel() else -1


def _comb(n: int, r: int, replacement: bool) -> int:
    """C(n, r) (with replacement C(n + r - 1, r)), capped at _BIG without computing huge numbers."""
    if r < 0 or n < 0:
        return 0
    if replacement:
        n = n + r - 1
    if r > n:
        return 0
    r = min(r, n - r)
    if r == 0:
        return 1
    log2 = (math.lgamma(n + 1) - math.lgamma(r + 1) - math.lgamma(n - r + 1)) / math.log(2)
    return _BIG if log2 > 61 else math.comb(n, r)


def _power(n: int, r: int) -> int:
    if n <= 1 or r <= 0:
        return max(n, 0) if r > 0 else 1
    return _BIG if r * math.log2(n) > 61 else n ** r


def _broadcast_numel(*shapes: torch.Size) -> int:
    try:
        return math.prod(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return 0   # torch refuses the call itself


def _bincount(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    x = _arg(args, kwargs, 0, "input", kwargs.get("self"))
    minlength = _int(_arg(args, kwargs, 2, "minlength", 0)) or 0
    if not isinstance(x, torch.Tensor):
        return None
    return max(_maximum(x) + 1, minlength, 0)


def _one_hot(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    x, n = _arg(args, kwargs, 0, "tensor"), _int(_arg(args, kwargs, 1, "num_classes", -1))
    if not isinstance(x, torch.Tensor):
        return None
    classes = n if n is not None and n > 0 else _maximum(x) + 1
    return x.numel() * max(classes, 0)


def _repeat_interleave(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    self = _arg(args, kwargs, 0, "input", kwargs.get("self"))
    repeats = _arg(args, kwargs, 1, "repeats")
    if repeats is None:   # repeat_interleave(repeats)
        return int(self.sum()) if isinstance(self, torch.Tensor) else None
    if not isinstance(self, torch.Tensor):
        return None
    dim = _int(_arg(args, kwargs, 2, "dim"))
    along = self.numel() if dim is None or self.dim() == 0 else self.shape[dim]
    rest = self.numel() // along if along else 0
    if isinstance(repeats, torch.Tensor) and repeats.numel() != 1:
        return rest * int(repeats.sum())
    r = _int(repeats)
    return rest * along * r if r is not None else None


def _combinations(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    x = _arg(args, kwargs, 0, "input", kwargs.get("self"))
    r = _int(_arg(args, kwargs, 1, "r", 2))
    replacement = bool(_arg(args, kwargs, 2, "with_replacement", False))
    if not isinstance(x, torch.Tensor) or r is None:
        return None
    return min(_comb(x.numel(), r, replacement) * max(r, 1), _BIG)


def _masked_select(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    x, mask = _arg(args, kwargs, 0, "input", kwargs.get("self")), _arg(args, kwargs, 1, "mask")
    if not isinstance(x, torch.Tensor) or not isinstance(mask, torch.Tensor) or mask.numel() == 0:
        return None
    whole = _broadcast_numel(x.shape, mask.shape)
    return int(mask.count_nonzero()) * (whole // mask.numel())


def _histogram(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    bins = _arg(args, kwargs, 1, "bins", 100)
    if isinstance(bins, torch.Tensor):
        return 2 * bins.numel()
    n = _int(bins)
    return 2 * n + 1 if n is not None else None


def _cov(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    x = _arg(args, kwargs, 0, "input", kwargs.get("self"))
    if not isinstance(x, torch.Tensor):
        return None
    variables = x.shape[0] if x.dim() == 2 else 1
    return variables * variables


def _binomial(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    count, prob = _arg(args, kwargs, 0, "count"), _arg(args, kwargs, 1, "prob")
    if not isinstance(count, torch.Tensor) or not isinstance(prob, torch.Tensor):
        return None
    return _broadcast_numel(count.shape, prob.shape)


def _grouped_mm(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    a, b, offs = _arg(args, kwargs, 0, "mat_a"), _arg(args, kwargs, 1, "mat_b"), kwargs.get("offs")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() < 2 or b.dim() < 2:
        return None
    groups = offs.numel() if isinstance(offs, torch.Tensor) else 1
    rows = a.numel() // max(a.shape[-1], 1)
    if a.dim() == 2 and b.dim() == 2:
        rows *= groups
    return rows * b.shape[-1]


def _one(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    return 1


def _istft(c: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The signal istft rebuilds: `length` samples when given (any number: it pads), else n_fft + hop * (frames - 1),
    per batch entry. (Its dry run fails: istft checks its window with torch.equal, which has no meta kernel.)"""
    x, n_fft = _arg(args, kwargs, 0, "input", kwargs.get("self")), _int(_arg(args, kwargs, 1, "n_fft"))
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or n_fft is None:
        return None
    hop = _int(_arg(args, kwargs, 2, "hop_length")) or max(n_fft // 4, 1)
    length = _int(_arg(args, kwargs, 8, "length"))
    batch = x.numel() // max(x.shape[-1] * x.shape[-2], 1)
    samples = length if length is not None else n_fft + hop * (x.shape[-1] - 1)
    return batch * max(samples, 0)


Estimate = Callable[[str, tuple[Any, ...], dict[str, Any]], "int | None"]

OUTPUT_ESTIMATES: dict[str, Estimate] = {
    "bincount": _bincount, "one_hot": _one_hot, "repeat_interleave": _repeat_interleave,
    "combinations": _combinations, "masked_select": _masked_select, "histogram": _histogram, "cov": _cov,
    "corrcoef": _cov, "binomial": _binomial, "grouped_mm": _grouped_mm, "allclose": _one, "istft": _istft,
}


def output_elements(category: str, api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The elements of the outputs of a call whose output size depends on its values (the meta dry run cannot tell),
    from the values; None for an API without an estimate."""
    estimate = OUTPUT_ESTIMATES.get(api)
    return estimate(category, args, kwargs) if estimate is not None else None


# -- intermediates ---------------------------------------------------------------------------------------------------
def _ints(value: Any, n: int, default: int) -> tuple[int, ...] | None:
    if value is None:
        return (default,) * n
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * n
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value) * n if len(value) == 1 else tuple(value[-n:]) if len(value) >= n else None
    return None


_CONV = {"conv1d": (1, False), "conv2d": (2, False), "conv3d": (3, False), "conv_transpose1d": (1, True),
         "conv_transpose2d": (2, True), "conv_transpose3d": (3, True)}


def _conv(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    """The unfolded-input ("im2col") buffer of a convolution without a direct kernel (float64 on a CPU bench):
    batch x in_channels * prod(kernel) x prod(output positions) for a convolution, batch x out_channels *
    prod(kernel) x prod(input positions) for a transposed one."""
    if api in ("convolution", "convolution_backward"):   # (grad_output,) input weight bias stride padding
        at = 1 if api == "convolution_backward" else 0       # dilation transposed output_padding groups
        x, w = _arg(args, kwargs, at, "input"), _arg(args, kwargs, at + 1, "weight")
        stride, padding, dilation = (_arg(args, kwargs, at + i, name) for i, name in
                                     ((3, "stride"), (4, "padding"), (5, "dilation")))
        transposed = bool(_arg(args, kwargs, at + 6, "transposed", False))
        groups = _arg(args, kwargs, at + 8, "groups", 1)
    else:   # conv{n}d(input, weight, bias, stride, padding, dilation, groups)
        x, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")   # conv_transpose{n}d(input,
        _, transposed = _CONV[api]           # weight, bias, stride, padding, output_padding, groups, dilation)
        stride, padding = _arg(args, kwargs, 3, "stride", 1), _arg(args, kwargs, 4, "padding", 0)
        dilation = _arg(args, kwargs, 7 if transposed else 5, "dilation", 1)
        groups = _arg(args, kwargs, 6, "groups", 1)
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or w.dim() < 3:
        return None
    n = w.dim() - 2
    kernel = tuple(w.shape[2:])
    batched = x.dim() == n + 2
    batch = x.shape[0] if batched else 1
    spatial = tuple(x.shape[-n:])
    channels = x.shape[-n - 1] if x.dim() > n else 1
    if transposed:
        g = groups if isinstance(groups, int) and groups > 0 else 1
        columns = w.shape[1] * g * math.prod(kernel) * math.prod(spatial)
        return batch * columns * ELEMENT_BYTES, f"the columns buffer of a transposed convolution ({batch} x {columns})"
    if padding in ("same", "valid"):
        out = spatial if padding == "same" else tuple(s - k + 1 for s, k in zip(spatial, kernel))
    else:
        s, p, d = _ints(stride, n, 1), _ints(padding, n, 0), _ints(dilation, n, 1)
        if s is None or p is None or d is None or min(s) <= 0:
            return None
        out = tuple((spatial[i] + 2 * p[i] - d[i] * (kernel[i] - 1) - 1) // s[i] + 1 for i in range(n))
    if min(out, default=1) <= 0:
        return None
    rows = channels * math.prod(kernel)
    return (batch * rows * math.prod(out) * ELEMENT_BYTES,
            f"the unfolded input (im2col) of the convolution ({batch} x {rows} x {math.prod(out)})")


def _mvlgamma(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    x, p = _arg(args, kwargs, 0, "input", kwargs.get("self")), _int(_arg(args, kwargs, 1, "p"))
    if not isinstance(x, torch.Tensor) or p is None:
        return None
    return x.numel() * max(p, 0) * ELEMENT_BYTES, f"mvlgamma's table of {x.numel()} x p={p} terms"


def _ctc(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    lp, lengths = _arg(args, kwargs, 0, "log_probs"), _arg(args, kwargs, 3, "target_lengths")
    if not isinstance(lp, torch.Tensor) or lp.dim() not in (2, 3):
        return None
    if isinstance(lengths, torch.Tensor):
        longest = _maximum(lengths.reshape(-1))
    elif isinstance(lengths, (list, tuple)) and lengths:
        longest = max(int(v) for v in lengths)
    else:
        longest = _int(lengths) or 0
    batch = lp.shape[1] if lp.dim() == 3 else 1
    states = 2 * max(longest, 0) + 1
    table = batch * lp.shape[0] * states
    return 2 * table * ELEMENT_BYTES, f"ctc_loss's alpha and beta tables ({batch} x {lp.shape[0]} x {states}, twice)"


def _combinations_masks(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    x, r = _arg(args, kwargs, 0, "input", kwargs.get("self")), _int(_arg(args, kwargs, 1, "r", 2))
    if not isinstance(x, torch.Tensor) or r is None:
        return None
    cells = _power(x.numel(), r)
    return min(2 * cells, _BIG), f"combinations' masks over {x.numel()}**{r} index tuples"


def _allclose(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    a, b = _arg(args, kwargs, 0, "input", kwargs.get("self")), _arg(args, kwargs, 1, "other")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    cells = _broadcast_numel(a.shape, b.shape)
    return 2 * cells * ELEMENT_BYTES, f"allclose's comparison of the broadcast inputs ({cells} elements)"


def _broadcast(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    """An element-wise computation over its tensor arguments broadcast together (gaussian_nll_loss: input, target
    and var of shapes (N, 1) and (1, N) make N x N terms, whatever the reduction)."""
    shapes = [t.shape for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if len(shapes) < 2:
        return None
    cells = _broadcast_numel(*shapes)
    return 2 * cells * ELEMENT_BYTES, f"the {api} terms of the broadcast inputs ({cells} elements)"


def _einsum_operands(args: tuple[Any, ...]) -> tuple[str, list[torch.Tensor]] | None:
    """(equation, operands) of torch.einsum / aten::einsum, the sublist format turned into an equation."""
    if args and isinstance(args[0], str):
        ops = args[1:]
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = tuple(ops[0])
        tensors = [t for t in ops if isinstance(t, torch.Tensor)]
        return (args[0], tensors) if len(tensors) == len(ops) else None
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

    def sub(seq: Any) -> str | None:
        if not isinstance(seq, (list, tuple)):
            return None
        out = ""
        for v in seq:
            if v is Ellipsis:
                out += "..."
            elif isinstance(v, int) and 0 <= v < len(letters):
                out += letters[v]
            else:
                return None
        return out

    tensors, subs = list(args[0::2]), list(args[1::2])
    output = None
    if len(tensors) > len(subs):      # an output sublist at the end
        output = sub(tensors.pop())
        if output is None:
            return None
    parts = [sub(s) for s in subs]
    if any(p is None for p in parts) or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    eq = ",".join(p for p in parts if p is not None) + (f"->{output}" if output is not None else "")
    return eq, tensors


def _einsum(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    """The largest product torch's einsum forms contracting left to right (the order it uses without opt_einsum;
    aten's `path` argument orders the pairs): `ij,jk,kl->il` on (N,1), (1,N), (N,1) forms an N x N product."""
    if "equation" in kwargs:
        args = (kwargs["equation"], *args)
    if "tensors" in kwargs:
        args = (*args, kwargs["tensors"])
    parsed = _einsum_operands(tuple(args))
    if parsed is None:
        return None
    equation, tensors = parsed
    equation = equation.replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(tensors) or len(terms) < 3:
        return None   # one or two operands: the product is the output, which the dry run bounds
    sizes: dict[str, int] = {}
    labels: list[set[str]] = []
    ellipsis: list[torch.Size] = []
    for term, t in zip(terms, tensors):
        letters = term.replace("...", "")
        spread = t.dim() - len(letters)
        if "..." in term:
            start = term.index("...")
            ellipsis.append(t.shape[start:start + spread] if spread > 0 else torch.Size([]))
        head = term.split("...")[0]
        tail = term.split("...")[1] if "..." in term else ""
        dims = list(t.shape[:len(head)]) + (list(t.shape[t.dim() - len(tail):]) if tail else [])
        for label, size in zip(head + tail, dims):
            sizes[label] = max(sizes.get(label, 1), size)
        labels.append(set(head + tail) | ({"."} if "..." in term else set()))
    sizes["."] = _broadcast_numel(*ellipsis) if ellipsis else 1
    output = set(rhs.replace("...", ".")) if "->" in equation else {
        label for label in sizes if sum(label in s for s in labels) == 1} | ({"."} if ellipsis else set())
    path = kwargs.get("path")
    order: list[tuple[int, int]] = []
    if isinstance(path, (list, tuple)) and len(path) % 2 == 0 and all(isinstance(v, int) for v in path):
        order = [(path[i], path[i + 1]) for i in range(0, len(path), 2)]
    given = bool(order)   # opt_einsum's convention: the pair's product goes to the end of the list
    peak = 0
    current = list(labels)
    while len(current) > 1:
        i, j = order.pop(0) if order else (0, 1)
        if not (0 <= i < len(current) and 0 <= j < len(current)) or i == j:
            return None
        a, b = current[i], current[j]
        rest = [s for k, s in enumerate(current) if k not in (i, j)]
        needed = output.union(*rest) if rest else output
        kept = (a | b) & needed
        cells = 1
        for label in kept:
            cells = min(cells * sizes.get(label, 1), _BIG)
        peak = max(peak, cells)
        current = rest + [kept] if given else [kept] + rest
    return min(peak * ELEMENT_BYTES, _BIG), f"einsum's pairwise products (the largest has {peak} elements)"


def _attention_scores(batch_heads_queries: int, keys: int, what: str) -> tuple[int, str]:
    cells = min(batch_heads_queries * keys, _BIG)
    return min(cells * ELEMENT_BYTES, _BIG), f"the attention scores of {what} ({cells} elements)"


def _sdpa(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    """Only with dropout: its replay recovers the keep-mask and computes the bench with the scores written out
    (gpu_server.replay.run.sdpa_reference); without dropout the kernel chooses its own (blockwise) algorithm."""
    q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
    p = _arg(args, kwargs, 4, "dropout_p", 0.0)
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2 or k.dim() < 2:
        return None
    if not isinstance(p, (int, float)) or p <= 0:
        return None
    return _attention_scores(q.numel() // max(q.shape[-1], 1), k.shape[-2], "scaled_dot_product_attention")


def _npu_attention(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str] | None:
    """The reference (gpu_server/replay/fused/attention.py) writes out batch x heads x S1 x S2 scores."""
    q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
    layout, heads = _arg(args, kwargs, 4, "input_layout"), _int(_arg(args, kwargs, 3, "head_num"))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or not isinstance(layout, str):
        return None
    if layout == "TND" and q.dim() == 3 and k.dim() == 3:
        qlen, kvlen = _arg(args, kwargs, 14, "actual_seq_qlen"), _arg(args, kwargs, 15, "actual_seq_kvlen")
        pairs = q.shape[0] * k.shape[0]
        if isinstance(qlen, (list, tuple)) and isinstance(kvlen, (list, tuple)) and len(qlen) == len(kvlen) and all(
                isinstance(v, int) for v in list(qlen) + list(kvlen)):
            ends_q, ends_k = [0, *qlen], [0, *kvlen]   # cumulative ends
            pairs = sum(max(ends_q[i + 1] - ends_q[i], 0) * max(ends_k[i + 1] - ends_k[i], 0)
                        for i in range(len(qlen)))
        return _attention_scores(pairs * q.shape[1], 1, "npu_fusion_attention")
    seq = {"BSH": (1, 1), "SBH": (0, 0), "BSND": (1, 1), "BNSD": (2, 2)}.get(layout)
    if seq is None or q.dim() <= seq[0] or k.dim() <= seq[1]:
        return None
    batch = q.shape[1] if layout == "SBH" else q.shape[0]
    n1 = heads if layout in ("BSH", "SBH") and heads else (q.shape[2] if layout == "BSND" else q.shape[1])
    return _attention_scores(batch * max(n1, 1) * q.shape[seq[0]], k.shape[seq[1]], "npu_fusion_attention")


Intermediate = Callable[[str, tuple[Any, ...], dict[str, Any]], "tuple[int, str] | None"]

INTERMEDIATE_ESTIMATES: dict[str, Intermediate] = {
    **{name: _conv for name in (*_CONV, "convolution", "convolution_backward")},
    "mvlgamma": _mvlgamma, "mvlgamma_": _mvlgamma, "special_multigammaln": _mvlgamma,
    "ctc_loss": _ctc, "combinations": _combinations_masks, "allclose": _allclose, "einsum": _einsum,
    "gaussian_nll_loss": _broadcast,
    "scaled_dot_product_attention": _sdpa, "npu_fusion_attention": _npu_attention,
}


def intermediate_bytes(category: str, api: str, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[int, str] | None:
    """(bytes, what) of the largest buffer the replay of this call forms besides its outputs, where that can be far
    more than its inputs and outputs; None when there is no such buffer (or no estimate for this API)."""
    estimate = INTERMEDIATE_ESTIMATES.get(api)
    return estimate(api, args, kwargs) if estimate is not None else None


def intermediate_allowance(record_elements: int) -> int:
    """The bytes an intermediate may take for a record carrying `record_elements` tensor elements."""
    return INTERMEDIATE_FACTOR * ELEMENT_BYTES * record_elements + INTERMEDIATE_SLACK_BYTES
