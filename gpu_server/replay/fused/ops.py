"""Reference implementations of the smaller torch_npu fused operators (everything except npu_fusion_attention).

Each function has torch_npu's documented signature and defaults and returns what torch_npu returns. They compute in
the dtype of their inputs, never move data to another device, never modify their inputs (``out=`` buffers are not
written: the updated values are returned), and are differentiable where the operator is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gpu_server.replay.fused.registry import reference

__all__ = [
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_scaled_masked_softmax",
    "npu_fast_gelu",
    "npu_linear",
    "npu_confusion_transpose",
    "npu_layer_norm_eval",
    "npu_apply_adam",
    "npu_apply_adam_w",
    "npu_group_norm_silu",
    "npu_mish",
    "npu_moe_gating_top_k_softmax",
    "npu_sort_v2",
]


def _scalar(x) -> float:
    if isinstance(x, torch.Tensor):
        return float(x.item())
    return float(x)


@reference("npu_rms_norm")
def npu_rms_norm(self, gamma, epsilon=1e-6):
    """``(y, rstd)``: ``rstd = 1/sqrt(mean(x^2) + epsilon)`` over the trailing ``gamma.dim()`` dims and
    ``y = x * rstd * gamma``.

    ``rstd`` keeps the reduced dims as size 1 and is float32 (float64 for float64 inputs), as on the NPU.
    """
    nd = gamma.dim()
    if nd == 0 or nd > self.dim() or tuple(self.shape[self.dim() - nd:]) != tuple(gamma.shape):
        raise ValueError(f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must equal the trailing dims of "
                         f"x shape {tuple(self.shape)}")
    dims = tuple(range(self.dim() - nd, self.dim()))
    rstd = torch.rsqrt(self.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = self * rstd * gamma
    return y, rstd.to(torch.promote_types(self.dtype, torch.float32))


@reference("npu_rotary_mul")
def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """``r1 * x + r2 * rotate(x)``; ``half``: rotate = cat(-x2, x1) of the two halves of the last dim;
    ``interleave``: rotate pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    if rotary_mode == "half":
        x1, x2 = torch.chunk(input, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        x1 = input[..., 0::2]
        x2 = input[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        raise ValueError(f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    return r1 * input + r2 * rotated


@reference("npu_swiglu")
def npu_swiglu(self, dim=-1):
    """``silu(a) * b`` with ``(a, b) = chunk(x, 2, dim)``."""
    if self.shape[dim] % 2:
        raise ValueError(f"npu_swiglu: size {self.shape[dim]} of dim {dim} is not even")
    a, b = torch.chunk(self, 2, dim=dim)
    return F.silu(a) * b


@reference("npu_scaled_masked_softmax")
def npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False):
    """``softmax((x * scale).masked_fill(mask, -10000), dim=-1)``; mask True = masked, broadcast to x.

    ``fixed_triu_mask=True`` (reserved in torch_npu) uses ``triu(ones(H, W), 1)`` instead of ``mask``.
    """
    if fixed_triu_mask:
        mask = torch.ones(x.shape[-2], x.shape[-1], dtype=torch.bool, device=x.device).triu(1)
    z = (x * scale).masked_fill(mask.bool(), -10000.0)
    return torch.softmax(z, dim=-1)


@reference("npu_fast_gelu")
def npu_fast_gelu(input):
    """``x * sigmoid(1.702 * x)`` (= x / (1 + exp(-1.702 x)), the documented FastGelu formula)."""
    return input * torch.sigmoid(1.702 * input)


@reference("npu_linear")
def npu_linear(input, weight, bias=None):
    """``input @ weight^T + bias``."""
    return F.linear(input, weight, bias)


@reference("npu_confusion_transpose")
def npu_confusion_transpose(self, perm, shape, transpose_first):
    """``transpose_first``: ``permute(perm)`` then reshape to ``shape``; else reshape to ``shape`` then permute."""
    perm = [int(p) for p in perm]
    shape = [int(s) for s in shape]
    if transpose_first:
        return self.permute(perm).reshape(shape)
    return self.reshape(shape).permute(perm)


@reference("npu_layer_norm_eval")
def npu_layer_norm_eval(input, normalized_shape, weight=None, bias=None, eps=1e-05):
    """``F.layer_norm(input, normalized_shape, weight, bias, eps)`` (weight, bias and eps are used)."""
    return F.layer_norm(input, [int(s) for s in normalized_shape], weight, bias, float(eps))


def _out_triple(name, out, var, m, v):
    if out is not None:
        if len(out) != 3:
            raise ValueError(f"{name}: out must be (var, m, v)")
        return out
    if var is None or m is None or v is None:
        raise ValueError(f"{name}: needs out=(var, m, v) (torch_npu has no functional variant)")
    return var, m, v


@reference("npu_apply_adam")
def npu_apply_adam(beta1_power, beta2_power, lr, beta1, beta2, epsilon, grad, use_locking=None, use_nesterov=None, *,
                   out=None, var=None, m=None, v=None):
    """One ApplyAdam step; returns the updated ``(var, m, v)`` without writing ``out``.

    ``m' = m + (1-beta1)(g-m)``, ``v' = v + (1-beta2)(g^2-v)``, ``lr_t = lr*sqrt(1-beta2_power)/(1-beta1_power)``,
    ``var' = var - lr_t*m'/(sqrt(v')+epsilon)``; with ``use_nesterov`` the numerator is ``beta1*m' + (1-beta1)*g``.
    """
    var, m, v = _out_triple("npu_apply_adam", out, var, m, v)
    b1, b2, eps = _scalar(beta1), _scalar(beta2), _scalar(epsilon)
    b1p, b2p = _scalar(beta1_power), _scalar(beta2_power)
    m_t = m + (1.0 - b1) * (grad - m)
    v_t = v + (1.0 - b2) * (grad * grad - v)
    lr_t = _scalar(lr) * math.sqrt(1.0 - b2p) / (1.0 - b1p)
    numer = b1 * m_t + (1.0 - b1) * grad if use_nesterov else m_t
    var_t = var - lr_t * numer / (torch.sqrt(v_t) + eps)
    return var_t, m_t, v_t


@reference("npu_apply_adam_w")
def npu_apply_adam_w(beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad, max_grad_norm=None,
                     amsgrad=None, maximize=None, *, out=None, var=None, m=None, v=None):
    """One ApplyAdamW step; returns the updated ``(var, m, v)`` without writing ``out``.

    ``beta*_power`` are the powers *before* this step (the op multiplies them by beta*). ``g = -grad`` if maximize;
    ``m' = beta1*m + (1-beta1)*g``; ``v' = beta2*v + (1-beta2)*g^2``;
    ``denom = sqrt(v_hat/(1-beta2_power*beta2)) + epsilon`` with ``v_hat = max(max_grad_norm, v')`` under amsgrad
    (``max_grad_norm`` is required then), else ``v'``; ``var' = var*(1-lr*wd) - lr*m'/(1-beta1_power*beta1)/denom``.
    """
    var, m, v = _out_triple("npu_apply_adam_w", out, var, m, v)
    b1, b2, eps = _scalar(beta1), _scalar(beta2), _scalar(epsilon)
    lr_, wd = _scalar(lr), _scalar(weight_decay)
    b1p = _scalar(beta1_power) * b1
    b2p = _scalar(beta2_power) * b2
    g = -grad if maximize else grad
    m_t = b1 * m + (1.0 - b1) * g
    v_t = b2 * v + (1.0 - b2) * g * g
    if amsgrad:
        if max_grad_norm is None:
            raise ValueError("npu_apply_adam_w: amsgrad=True needs max_grad_norm")
        v_hat = torch.maximum(max_grad_norm.to(v_t.dtype), v_t)
    else:
        v_hat = v_t
    denom = torch.sqrt(v_hat / (1.0 - b2p)) + eps
    var_t = var * (1.0 - lr_ * wd) - lr_ * m_t / (1.0 - b1p) / denom
    return var_t, m_t, v_t


@reference("npu_group_norm_silu")
def npu_group_norm_silu(input, weight, bias, group, eps=0.00001):
    """``(silu(group_norm(x)), mean, rstd)``; groups split dim 1; mean and rstd have shape (N, group)."""
    group = int(group)
    if input.dim() < 2 or group <= 0 or input.shape[1] % group:
        raise ValueError(f"npu_group_norm_silu: dim 1 of shape {tuple(input.shape)} must be divisible by "
                         f"group {group}")
    n, c = input.shape[0], input.shape[1]
    xg = input.reshape(n, group, -1)
    mean = xg.mean(dim=-1)
    var = (xg - mean.unsqueeze(-1)).pow(2).mean(dim=-1)
    rstd = torch.rsqrt(var + eps)
    y = ((xg - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).reshape(input.shape)
    affine_shape = (1, c) + (1,) * (input.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(affine_shape)
    if bias is not None:
        y = y + bias.reshape(affine_shape)
    return F.silu(y), mean, rstd


@reference("npu_mish")
def npu_mish(self):
    """``x * tanh(softplus(x))``."""
    return F.mish(self)


@reference("npu_moe_gating_top_k_softmax")
def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """``(y, expert_idx, row_idx)``: top-k of ``softmax(x, -1)`` (ties: lower expert first), indices int32.

    Rows with ``finished`` True get expert index = number of experts. ``row_idx[..., j] = j * rows + row`` (rows =
    product of the leading dims), as the documented ``arange(rows*k).reshape(k, rows).T``.
    """
    k = int(k)
    experts = x.shape[-1]
    if x.dim() not in (2, 3) or not 0 < k <= experts:
        raise ValueError(f"npu_moe_gating_top_k_softmax: needs 2-D/3-D x and 0 < k <= {experts}")
    p = torch.softmax(x, dim=-1)
    order = torch.sort(p.detach(), dim=-1, descending=True, stable=True).indices[..., :k]
    y = torch.gather(p, -1, order)
    idx = order.to(torch.int32)
    if finished is not None:
        idx = idx.masked_fill(finished.bool().unsqueeze(-1), experts)
    rows = math.prod(x.shape[:-1])
    row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).reshape(k, rows).t().reshape(idx.shape)
    return y, idx, row_idx


@reference("npu_sort_v2")
def npu_sort_v2(self, dim=-1, descending=False, out=None):
    """Sorted values only (no indices); ``out`` is not written."""
    return torch.sort(self, dim=dim, descending=bool(descending), stable=True).values
