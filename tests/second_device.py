"""A second, CORRECT device for the tests: kernels that compute the same math as the host's CPU kernels but round
differently, installed in the TRAINING process only.

A real NPU or GPU computes matmuls, reductions and normalisations in another order, with other blocking and fused
kernels: its outputs differ from the host's same-dtype run by a few units in the last place, yet nothing is wrong.
`install()` reproduces that on the CPU. Every kernel is registered for the CPU dispatch key of its aten operator
through `torch.library.Library("aten", "IMPL")` (no TorchDispatchMode is needed: every op family below has a CPU
kernel to replace). Autograd sits above the CPU key, so the backward formulas are torch's own, fed with this
device's forward outputs (softmax's backward uses the device's softmax output, as on a real device).

What each replacement does (float32 / bfloat16 / float16; float64 and other dtypes fall through to exact math in
float64, which is still correct):
- `mm`, `addmm`, `bmm`: every product exact in float32 (16-bit inputs) or rounded once in float32 (float32 inputs),
  the K products summed in float32 in blocks of `BLOCK`, the block sums added in REVERSE block order, the bias
  added in float32, one rounding to the output dtype. The host (oneDNN/MKL) sums in its own blocking.
- `convolution` (2-D, ungrouped): im2col, then the matmul above (products over C*kh*kw in blocks, reversed).
- `_softmax`, `_log_softmax`: in float32 for 16-bit inputs (float64 for float32), the row sum over the REVERSED row
  accumulated in float64;
  backward (`_softmax_backward_data`, `_log_softmax_backward_data`) the same, from the device's forward output.
- `native_layer_norm`: two-pass mean and variance over the reversed row, sums in float64 (the host uses Welford),
  float32 outputs computed in float64, 16-bit ones in float32; `native_layer_norm_backward` likewise, reversed.
- `gelu`, `gelu_backward`: computed in float64 and rounded once (correctly rounded up to double rounding).

Each is at least as accurate against float64 as the host's kernel (tests/test_second_device.py measures it).
A replacement never calls the operator it replaces; it computes below autograd with torch functions disabled so
that no capture mode sees its inner ops.

How differently (tests/test_second_device.py measures it bitwise against the host's kernels, per kernel and dtype):
every float32 output differs, and so do gelu's and log_softmax's 16-bit ones. Only pairs in MAY_MATCH_16BIT may come
out bit-identical on the test's inputs: 16-bit outputs of a float32 accumulation (the host's is float32 too), where
another summation order moves the float32 result by a few float32 ULP, which rounding to bfloat16 (8 bits) or float16
(11 bits) almost never sees. Which of them do depends on the host CPU's kernels: 8 of the 12 on both CPUs measured
(16 of the 24 pairs differ), bmm's float16 output identical on one with AMX and avx512_fp16, addmm's on the other.
Making them differ would take a less accurate kernel (a rounding to the output dtype before the bias, a 16-bit
accumulation): the device would no longer be correct, which is the point of it.

Use: `install()` once at the top of a training process, before the model runs; or set `SECOND_DEVICE=1` for the
training entry point of tests/faulty_kernels.py (a fault case installed after it overrides its own operator only).
"""
from __future__ import annotations

import contextlib
import math
import warnings

import torch

# (kernel, dtype) pairs of tests/test_second_device.py's accuracy check whose outputs may equal the host's bitwise:
# the 16-bit outputs of the kernels that accumulate in float32 (which of them do depends on the host CPU's kernels)
MAY_MATCH_16BIT = frozenset(f"{kernel}|torch.{dtype}" for dtype in ("bfloat16", "float16")
                            for kernel in ("mm", "addmm", "bmm", "conv2d", "layer_norm", "softmax"))

BLOCK = 8                 # products per float32 partial sum in the matmul family
_ROW_CHUNK = 1 << 20      # elements of the (rows, K, N) product tensor built at once
_LIBS: list = []
_installed = False


@contextlib.contextmanager
def _below():
    with torch._C._AutoDispatchBelowAutograd(), torch._C.DisableTorchFunction():
        yield


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: float32 for float32 and 16-bit floats (as the host), float64 otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float64


# -- matmul family -------------------------------------------------------------------------------------------------
def _blocked_matmul(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """(..., M, K) @ (..., K, N) in `acc`: products, sums of BLOCK products, block sums added in reverse order."""
    a, b = a.to(acc), b.to(acc)
    k = a.shape[-1]
    out = None
    starts = list(range(0, k, BLOCK))
    rows = a.shape[-2]
    per_row = BLOCK * b.shape[-1] * math.prod(a.shape[:-2])
    step = max(1, _ROW_CHUNK // max(1, per_row))
    for s in reversed(starts):
        ab, bb = a[..., s:s + BLOCK], b[..., s:s + BLOCK, :]
        parts = []
        for r in range(0, rows, step):
            prod = ab[..., r:r + step, :].unsqueeze(-1) * bb.unsqueeze(-3)   # (..., r, block, N)
            parts.append(prod.sum(dim=-2))
        block = torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]
        out = block if out is None else out + block
    if out is None:
        shape = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
        out = torch.zeros(shape, dtype=acc)
    return out


def _mm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    with _below():
        dtype = torch.promote_types(self.dtype, mat2.dtype)
        if not dtype.is_floating_point:
            return (self.double() @ mat2.double()).to(dtype)
        return _blocked_matmul(self, mat2, _acc(dtype)).to(dtype)


def _bmm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    return _mm(self, mat2)


def _addmm(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    with _below():
        dtype = torch.promote_types(torch.promote_types(mat1.dtype, mat2.dtype), bias.dtype)
        acc = _acc(dtype)
        out = _blocked_matmul(mat1, mat2, acc)
        if alpha != 1:
            out = out * alpha
        if beta != 0:
            out = out + bias.to(acc) * beta
        return out.to(dtype)


def _norm_acc(dtype: torch.dtype) -> torch.dtype:
    """Normalisations and softmax: float64 for float32 (no less accurate than the host), float32 for 16-bit."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """2-D, ungrouped, not transposed: im2col and the blocked matmul above; anything else: the host's kernel one
    level down (aten::_convolution)."""
    with _below():
        if transposed or groups != 1 or x.dim() != 4 or not x.dtype.is_floating_point:
            return torch.ops.aten._convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding,
                                               groups, False, False, True, True)
        n, _, h, w = x.shape
        o, _, kh, kw = weight.shape
        cols = torch.nn.functional.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)
        acc = _acc(x.dtype)
        out = _blocked_matmul(weight.reshape(o, -1).unsqueeze(0).expand(n, -1, -1), cols, acc)   # (N, O, L)
        if bias is not None:
            out = out + bias.to(acc).view(1, o, 1)
        oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        return out.reshape(n, o, oh, ow).to(x.dtype)


# -- softmax family ------------------------------------------------------------------------------------------------
def _rsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Row sum over the reversed row, accumulated in float64 (another order than the host's, and no less accurate),
    returned in x's dtype."""
    return x.flip(dim).sum(dim=dim, keepdim=True, dtype=torch.float64).to(x.dtype)


def _softmax(self: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    with _below():
        out_dtype = torch.float32 if half_to_float else self.dtype
        x = self.to(_norm_acc(self.dtype))
        if x.numel() == 0:
            return x.to(out_dtype)
        e = (x - x.amax(dim=dim, keepdim=True)).exp()
        return (e / _rsum(e, dim)).to(out_dtype)


def _log_softmax(self: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    with _below():
        out_dtype = torch.float32 if half_to_float else self.dtype
        x = self.to(_norm_acc(self.dtype))
        if x.numel() == 0:
            return x.to(out_dtype)
        shifted = x - x.amax(dim=dim, keepdim=True)
        return (shifted - _rsum(shifted.exp(), dim).log()).to(out_dtype)


def _softmax_backward(grad_output: torch.Tensor, output: torch.Tensor, dim: int, input_dtype) -> torch.Tensor:
    with _below():
        acc = _norm_acc(grad_output.dtype)
        g, y = grad_output.to(acc), output.to(acc)
        return (y * (g - _rsum(g * y, dim))).to(input_dtype if grad_output.dtype != input_dtype
                                                   and input_dtype.is_floating_point else grad_output.dtype)


def _log_softmax_backward(grad_output: torch.Tensor, output: torch.Tensor, dim: int, input_dtype) -> torch.Tensor:
    with _below():
        acc = _norm_acc(grad_output.dtype)
        g, y = grad_output.to(acc), output.to(acc)
        return (g - y.exp() * _rsum(g, dim)).to(input_dtype if grad_output.dtype != input_dtype
                                                 and input_dtype.is_floating_point else grad_output.dtype)


# -- layer_norm ----------------------------------------------------------------------------------------------------
def _norm_dims(x: torch.Tensor, normalized_shape) -> tuple[int, ...]:
    return tuple(range(x.dim() - len(normalized_shape), x.dim()))


def _rmean(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(x.shape[d] for d in dims) if dims else 1
    return (x.flip(dims).sum(dim=dims, keepdim=True, dtype=torch.float64) / n).to(x.dtype)


def _native_layer_norm(x: torch.Tensor, normalized_shape, weight, bias, eps: float):
    with _below():
        acc = _norm_acc(x.dtype)
        dims = _norm_dims(x, normalized_shape)
        xw = x.to(acc)
        mean = _rmean(xw, dims)
        centered = xw - mean
        var = _rmean(centered * centered, dims)
        rstd = (var + eps).rsqrt()
        out = centered * rstd
        if weight is not None:
            out = out * weight.to(acc)
        if bias is not None:
            out = out + bias.to(acc)
        return out.to(x.dtype), mean.to(x.dtype), rstd.to(x.dtype)


def _native_layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    with _below():
        acc = _norm_acc(x.dtype)
        dims = _norm_dims(x, normalized_shape)
        outer = tuple(range(x.dim() - len(normalized_shape)))
        g, xw, mu, rs = grad_out.to(acc), x.to(acc), mean.to(acc), rstd.to(acc)
        x_hat = (xw - mu) * rs
        gw = g * weight.to(acc) if weight is not None else g
        grad_input = grad_weight = grad_bias = None
        if output_mask[0]:
            grad_input = (rs * (gw - _rmean(gw, dims) - x_hat * _rmean(gw * x_hat, dims))).to(x.dtype)
        if output_mask[1] and weight is not None:
            grad_weight = (g * x_hat).flip(outer).sum(dim=outer).to(weight.dtype) if outer else (g * x_hat).to(
                weight.dtype)
        if output_mask[2] and bias is not None:
            grad_bias = g.flip(outer).sum(dim=outer).to(bias.dtype) if outer else g.to(bias.dtype)
        return grad_input, grad_weight, grad_bias


# -- gelu (correctly rounded, up to double rounding) ---------------------------------------------------------------
_SQRT_2_PI = math.sqrt(2 / math.pi)


def _gelu(self: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    with _below():
        x = self.double()
        if approximate == "tanh":
            y = 0.5 * x * (1 + torch.tanh(_SQRT_2_PI * (x + 0.044715 * x * x * x)))
        else:
            y = 0.5 * x * (1 + torch.erf(x * (1 / math.sqrt(2))))
        return y.to(self.dtype)


def _gelu_backward(grad_output: torch.Tensor, self: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    with _below():
        x, g = self.double(), grad_output.double()
        if approximate == "tanh":
            inner = _SQRT_2_PI * (x + 0.044715 * x * x * x)
            t = torch.tanh(inner)
            d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_PI * (1 + 3 * 0.044715 * x * x)
        else:
            d = 0.5 * (1 + torch.erf(x * (1 / math.sqrt(2)))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        return (g * d).to(grad_output.dtype)


KERNELS = {
    "convolution": _convolution,
    "mm": _mm,
    "bmm": _bmm,
    "addmm": _addmm,
    "_softmax": _softmax,
    "_log_softmax": _log_softmax,
    "_softmax_backward_data": _softmax_backward,
    "_log_softmax_backward_data": _log_softmax_backward,
    "native_layer_norm": _native_layer_norm,
    "native_layer_norm_backward": _native_layer_norm_backward,
    "gelu": _gelu,
    "gelu_backward": _gelu_backward,
}


def install() -> None:
    """Replace the CPU kernels of KERNELS' aten operators in this process (for the rest of its life). Idempotent."""
    global _installed
    if _installed:
        return
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Overriding a previously registered kernel": that is the point
        for op, fn in KERNELS.items():
            lib.impl(op, fn, "CPU")
    _LIBS.append(lib)
    _installed = True


def ulp_ratios(out_dir: str, rank: int, prefix: str) -> list[float]:
    """The ULP standard's share ratio (ULP误差大于阈值占比比值: the device's share of elements over the ULP threshold
    over the host's same-dtype run's) of the rows of `rank`'s api_precision_compare_details whose API name starts
    with `prefix`. A device computing exactly like the host gives 1 (or 0 where both shares are 0) in every row."""
    from tests import support

    ratios = []
    for row in support.read_csv(out_dir, "api_precision_compare_details", rank):
        cell = row.get("ULP误差大于阈值占比比值", "").strip()
        if row["API Name"].startswith(prefix) and row["比对算法"] == "ULP误差比对法" and cell:
            ratios.append(float(cell))
    return ratios
