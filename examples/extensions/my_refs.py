"""References for the custom operators of examples/extensions/train_custom.py (docs/extensions.md).

The server imports this module because the extension file (extensions.toml, beside it) names its functions. Each
reference takes the operator's arguments, in its order and with its names, and returns what the operator returns,
computed in plain torch in the dtype of its inputs (the server upcasts them for the bench run: float32 -> float64).
"""
from __future__ import annotations

import math

import torch


def fused_gelu(x: torch.Tensor) -> torch.Tensor:
    """mylib::fused_gelu: the exact (erf) GELU."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def fused_gelu_backward(grad_outputs: tuple[torch.Tensor, ...], x: torch.Tensor) -> tuple[torch.Tensor]:
    """Its gradient, given one gradient per output and the forward's inputs; one gradient per positional input.
    (Optional: without `backward =` the server differentiates `fused_gelu` itself.)"""
    (grad,) = grad_outputs
    cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return (grad * (cdf + x * pdf),)


def grouped_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """mylib::grouped_rows: 2 * sin(x) on the first `count` rows. The device kernel leaves the other rows as they
    were (stale memory); the extension file's [[postprocess]] says only the first `count` rows are compared, so the
    reference may compute them all."""
    return 2.0 * torch.sin(x)
