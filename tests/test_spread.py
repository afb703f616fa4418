"""gpu_server/replay/spread.py: stochastic rounding, the stochastic-rounding and sequential-accumulation replay modes,
which runs make the spread, and the confidence bounds."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gpu_server.judging.metrics import output_metrics
from gpu_server.judging.standards.registry import StandardInput, wilson
from gpu_server.judging.standards.ulp import ulp_error
from gpu_server.replay import spread
from gpu_server.replay.spread import SequentialAccumulation, StochasticRounding, sequential_product, stochastic_round


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


def _gamma_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Higham's bound for K rounded products summed: |error| <= gamma_(K+1) (|a| @ |b|), gamma_n = n u / (1 - n u)."""
    u, k = 2.0 ** -24, a.shape[-1] + 1
    return k * u / (1 - k * u) * (a.double().abs() @ b.double().abs())


def test_sequential_run_replaces_matrix_products_only():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 64, 300, generator=g), torch.randn(4, 300, 32, generator=g)
    bias = torch.randn(32, generator=g)
    exact = a.double() @ b.double()
    with SequentialAccumulation() as mode:
        mm = torch.mm(a[0], b[0])
        addmm = torch.addmm(bias, a[0], b[0], beta=0.5, alpha=2.0)
        bmm = torch.bmm(a, b)
        baddbmm = torch.baddbmm(bias.expand(4, 64, 32), a, b)
        soft = torch.softmax(a, -1)
    assert mode.touched and not mode.random
    for got, want, scale in ((mm, exact[0], 1.0), (addmm, 0.5 * bias.double() + 2.0 * exact[0], 2.0),
                             (bmm, exact, 1.0), (baddbmm, bias.double() + exact, 1.0)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        bound = scale * _gamma_bound(a[0] if got.dim() == 2 else a, b[0] if got.dim() == 2 else b) + 1e-6
        assert ((got.double() - want).abs() <= bound).all()
    assert not torch.equal(bmm, torch.bmm(a, b))            # another order than the host's: other roundings
    assert torch.equal(soft, torch.softmax(a, -1))           # every other op is the host's
    with SequentialAccumulation() as other:
        torch.softmax(a, -1) + 1
    assert not other.touched                                 # no product: the run would repeat the host's


def test_sequential_product_sums_in_order_without_fused_multiply_add():
    a = torch.tensor([[1.0, 2.0 ** -24, 2.0 ** -24]])
    b = torch.ones(3, 1)
    assert sequential_product(a, b, torch.float32).item() == 1.0             # each tiny term is lost on its own
    assert sequential_product(a.flip(-1), b, torch.float32).item() == 1.0 + 2.0 ** -23   # summed first they count
    half = torch.tensor([[1.0, 2.0 ** -9]], dtype=torch.bfloat16)
    out = sequential_product(half, torch.ones(2, 1, dtype=torch.bfloat16), torch.float32)
    assert out.dtype == torch.float32 and out.item() == 1.0 + 2.0 ** -9      # 16-bit inputs accumulate in float32


def _long_sum(seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 product with K = 2048 and cancelling columns, the shape of a transformer's grad_input: its mean ULP
    error is above 64 (rows of mean 2 against zero-mean columns), so the ULP standard judges the over-threshold share
    against the same-dtype runs."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(256, 2048, generator=g) + 2, torch.randn(2048, 256, generator=g)
    return a.to(device), (b - b.mean(0, keepdim=True)).to(device)


def _ulp_status(device: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sequential: bool) -> str:
    bench = a.double() @ b.double()
    members = []
    for run in range(spread.SPREAD_RUNS):
        with StochasticRounding(run):
            members.append(a @ b)
    if sequential:
        with SequentialAccumulation():
            members.append(a @ b)
    metric = lambda t: output_metrics(bench, t)   # noqa: E731
    return ulp_error(StandardInput(torch.float32, metric(device), metric(a @ b),
                                   tuple(metric(m) for m in members))).status


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_device_that_sums_sequentially_is_not_accused_by_a_blocked_bench(seed, device):
    """The host's float32 `mm` sums in blocks; a correct device summing K = 2048 products one at a time, in reverse,
    has about twice its over-threshold share. Without the sequential run the spread (host + faithfully rounded runs)
    accuses it; with it, it passes. A device off by more than the order of a sum still fails."""
    a, b = _long_sum(seed, device)
    reverse = sequential_product(a.flip(-1), b.flip(-2), torch.float32)
    assert _ulp_status(reverse, a, b, sequential=False) == "error"
    assert _ulp_status(reverse, a, b, sequential=True) == "pass"
    bf16_sums = a.double() @ b.double()          # the same sums, each result kept to 16 bits: a fault
    assert _ulp_status(bf16_sums.to(torch.bfloat16).float(), a, b, sequential=True) == "error"
    coarse = reverse + (reverse - a.double().matmul(b.double()).float()) * 2   # three times the sequential error
    assert _ulp_status(coarse, a, b, sequential=True) == "error"


def test_the_sequential_run_joins_the_spread_only_for_calls_with_a_product():
    job = SimpleNamespace(rank=0, step=1, name="Functional.linear.0", rng_state=None)
    x, w = torch.randn(8, 40), torch.randn(40, 8)
    assert len(spread._members(job, job, lambda: [torch.softmax(x, -1)])) == spread.SPREAD_RUNS
    runs = spread._members(job, job, lambda: [x @ w])
    assert len(runs) == spread.SPREAD_RUNS + spread.SEQUENTIAL_RUNS
    with SequentialAccumulation():
        assert torch.equal(runs[-1][0], x @ w)                 # the last member is the sequential run
    assert spread._members(SimpleNamespace(**(job.__dict__ | {"rng_state": b"s"})), job, lambda: [x @ w]) == []


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
