"""A training with two custom torch.library operators, for tests/test_extensions.py (run in its own process by
tests/support.run_training). argv: agent config[, steps (default 2)].

- mylib::fused_gelu(x): the exact GELU, with register_fake and register_autograd. With OCHECK_GELU_BUG=1 the kernel
  is slightly wrong (scaled by 1 + 2^-8), as a faulty device kernel would be.
- mylib::grouped_rows(x, count): 2 sin(x) on the first `count` rows only; the other rows of its output are left as
  they were (filled with 1e4 here, standing for stale memory), as fused grouped kernels do.
Prints "TRAINING DONE <last loss>".
"""
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
    y = 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    return y * (1.0 + 2.0 ** -8) if BUG else y


@fused_gelu.register_fake
def _gelu_fake(x):
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
    out = torch.full_like(x, 1.0e4)          # the rows it does not write: stale memory
    out[:count] = 2.0 * torch.sin(x[:count])
    return out


@grouped_rows.register_fake
def _rows_fake(x, count):
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

torch.manual_seed(0)
model = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])
opt = torch.optim.SGD(model.parameters(), lr=0.05)
dbg = PrecisionDebugger(config_path=sys.argv[1])
for _step in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
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
