"""A simulated device bug for `bash scripts/demo.sh --fault`: NOT a real fault of your machine.

`install()` replaces the CPU kernel of one aten operator, `aten::gelu`, in the training process only (through
`torch.library`), with one whose outputs are 1.6 % too large (scaled by 1 + 2^-6 before rounding): the kind of bug a
new accelerator's activation kernel can have. The server, another process, keeps the true kernel, so the report
flags `Functional.gelu` forward in every block's MLP, and its top-down view names the first such call, its module
path and the line of `examples/demo.py` that called it.
"""
from __future__ import annotations

import warnings

import torch

SCALE = 1 + 2.0 ** -6
_LIBS: list = []


def _gelu_too_large(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    """gelu computed in float64 below autograd (so no capture mode sees the inner ops), scaled, rounded once."""
    with torch._C._AutoDispatchBelowAutograd(), torch._C.DisableTorchFunction():
        w = x.double()
        if approximate == "tanh":
            y = 0.5 * w * (1 + torch.tanh(0.7978845608028654 * (w + 0.044715 * w ** 3)))
        else:
            y = 0.5 * w * (1 + torch.erf(w * 0.7071067811865476))
        return (y * SCALE).to(x.dtype)


def install() -> None:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "overriding a previously registered kernel": that is the point
        lib.impl("gelu", _gelu_too_large, "CPU")
    _LIBS.append(lib)
