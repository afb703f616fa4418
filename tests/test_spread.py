"""gpu_server/replay/spread.py: stochastic rounding, the stochastic-rounding replay mode and the confidence bounds."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_server.judging.standards.registry import wilson
from gpu_server.replay.spread import StochasticRounding, stochastic_round


def test_stochastic_rounding_is_faithful_and_unbiased():
    g = torch.Generator().manual_seed(0)
    for wide, dtype in ((torch.randn(200_000), torch.bfloat16), (torch.randn(200_000) * 0.5 + 2, torch.float16),
                        (torch.randn(200_000, dtype=torch.float64), torch.float32)):
        r = stochastic_round(wide, dtype, g)
        assert r.dtype == dtype
        nearest = wide.to(dtype)
        # faithful: within one spacing of the exact value (spacing 2^(floor(log2|x|) - p))
        p = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
        _, e = torch.frexp(wide.double())
        assert ((r.double() - wide.double()).abs() <= torch.exp2((e - 1 - p).double())).all()
        # unbiased: the mean error is far below the round-to-nearest error
        mean_err = (r.to(torch.float64) - wide.to(torch.float64)).mean().abs()
        rn_err = (nearest.to(torch.float64) - wide.to(torch.float64)).abs().mean()
        assert mean_err < rn_err / 20
        assert 0.15 < float((r != nearest).double().mean()) < 0.35   # about a quarter take the other neighbour


def test_exact_values_stay_exact():
    g = torch.Generator().manual_seed(1)
    x = torch.tensor([0.0, 1.0, -2.5, 3.0, float("inf"), float("nan")])
    r = stochastic_round(x, torch.bfloat16, g)
    assert torch.equal(r[:5], x[:5].to(torch.bfloat16)) and torch.isnan(r[5])


def test_mode_changes_rounding_ops_only():
    torch.manual_seed(0)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with StochasticRounding(3) as mode:
        y = torch.softmax(x, -1)
        idx = torch.argmax(x, -1)
        r = F.relu(x)
    assert not mode.random
    assert (y != torch.softmax(x, -1)).any()                       # rounded ops: other rounding decisions
    assert ((y.float() - torch.softmax(x.float(), -1)).abs() <= 2.0 ** -7).all()   # within one ULP of [0, 1]
    assert torch.equal(idx, torch.argmax(x, -1)) and torch.equal(r, F.relu(x))   # exact ops unchanged


def test_mode_notices_random_ops():
    x = torch.randn(8, 8)
    with StochasticRounding(0) as mode:
        F.dropout(x, 0.5, training=True)
    assert mode.random


def test_wilson_bounds():
    assert wilson(0, 1000, upper=False) == 0.0
    assert 0.008 < wilson(0, 1000, upper=True) < 0.01        # z = 3: "none of 1000" still allows ~0.9 %
    lo, hi = wilson(6, 10, upper=False), wilson(3, 10, upper=True)
    assert lo < hi                                             # 6/10 vs 3/10 on ten elements: not distinguishable
    assert wilson(600, 1000, upper=False) > wilson(300, 1000, upper=True)
    assert wilson(5, 0, upper=True) == 1.0 and wilson(5, 0, upper=False) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mode_on_cuda():
    """The mode keeps a generator per device: a CUDA bench host gets stochastic-rounding runs as well."""
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    with StochasticRounding(5) as mode:
        y = x @ x.T
    ref = (x.float() @ x.float().T)
    assert y.device.type == "cuda" and not mode.random
    assert (y != ref.to(torch.bfloat16)).any()
    _, e = torch.frexp(ref.double())
    assert ((y.double() - ref.double()).abs() <= torch.exp2((e - 1 - 7).double()) + 1e-30).all()
