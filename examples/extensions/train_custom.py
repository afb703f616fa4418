"""A small training with two custom torch.library operators, checked online (docs/extensions.md).

    gpu-server --config server.json --out ./results --extensions examples/extensions/extensions.toml
    python examples/extensions/train_custom.py agent_config.json
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from npu_agent import PrecisionDebugger

BUG = os.environ.get("OCHECK_GELU_BUG") == "1"


@torch.library.custom_op("mylib::fused_gelu", mutates_args=())
def fused_gelu(x: torch.Tensor) -> torch.Tensor:
    """The device's kernel (here: plain torch; OCHECK_GELU_BUG=1 plants a bug: every value 1 + 2^-8 too large, as a
    faulty kernel would be, to see the report name it)."""
    y = 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    return y * (1.0 + 2.0 ** -8) if BUG else y


@fused_gelu.register_fake
def _(x):
    return torch.empty_like(x)


def _gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _gelu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    return grad * (cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))


fused_gelu.register_autograd(_gelu_backward, setup_context=_gelu_setup)


@torch.library.custom_op("mylib::grouped_rows", mutates_args=())
def grouped_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """Writes only the first `count` rows; the rest of the output is whatever the buffer held."""
    out = torch.full_like(x, 1.0e4)   # stands for stale memory
    out[:count] = 2.0 * torch.sin(x[:count])
    return out


@grouped_rows.register_fake
def _(x, count):
    return torch.empty_like(x)


def _rows_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.count = inputs[1]


def _rows_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    gx = torch.zeros_like(x)
    gx[:ctx.count] = grad[:ctx.count] * 2.0 * torch.cos(x[:ctx.count])
    return gx, None


grouped_rows.register_autograd(_rows_backward, setup_context=_rows_setup)


def main(config: str, steps: int = 2) -> None:
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dbg = PrecisionDebugger(config_path=config)
    for _ in range(steps):
        x, y = torch.randn(6, 8), torch.randn(3, 4)
        dbg.start()
        h = grouped_rows(fused_gelu(model[0](x)), 3)
        loss = F.mse_loss(model[1](h[:3]), y)
        loss.backward()
        dbg.stop()
        opt.step()
        opt.zero_grad()
        dbg.step()
    dbg.close()
    print("TRAINING DONE", float(loss))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
