"""Random and uninitialised outputs are never false errors (issue 10 item 3): real trainings (a mixture-of-experts
model with `empty_like`, attention with dropout, rrelu, random draws) through a real server. Every call is pass or a
SKIP with its reason; calls whose random stream can be reproduced are exact passes; uninitialised outputs are SKIP.
Plus the replay rules measured on this host: the keep-mask recovered from the kernel, draws in the recorded dtype."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_server.replay.run import ReplayError, run_backward, run_forward, sdpa_keep_mask
from tests.support import Server, agent_config, capture, read_csv, run_training, to_job

CPU = torch.device("cpu")

TRAIN = r"""
import sys, torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger

torch.manual_seed(0)
dtype = getattr(torch, sys.argv[2])

class MoE(nn.Module):
    def __init__(self, d=16, experts=3, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        h = x + a.transpose(1, 2).reshape(b, t, d)
        flat = h.reshape(-1, d)
        logits = self.router(flat) + 0.01 * torch.randn_like(flat[:, :3])        # router jitter
        probs = logits.float().softmax(-1)
        top = probs.argmax(-1)
        sampled = torch.multinomial(probs.detach(), 1)                              # exploration
        keep = torch.bernoulli(torch.full_like(probs[:, :1], 0.9))
        order = torch.argsort(top)
        pieces = [self.experts[e](flat[top == e]) for e in range(len(self.experts))]
        out = torch.empty_like(flat)                                                # uninitialised buffer
        out[order] = torch.cat(pieces)
        out = F.rrelu(out, training=True)
        out = F.dropout(out, 0.1, True) * keep.to(out.dtype) + 0 * sampled.to(out.dtype)
        return self.head(out).float().logsumexp(-1).mean()

model = MoE().to(dtype)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
dbg = PrecisionDebugger(config_path=sys.argv[1])
for step in range(2):
    x = torch.randn(2, 8, 16, dtype=dtype)
    dbg.start()
    loss = model(x)
    loss.backward()
    dbg.stop()
    opt.step()
    opt.zero_grad()
    dbg.step()
counts = dbg.close()
assert counts["unacknowledged"] == 0 and counts["dropped"] == 0 and counts["rejected"] == 0, counts
"""

RANDOM_CALLS = ("Functional.scaled_dot_product_attention", "Torch.randn_like", "Torch.multinomial", "Torch.bernoulli",
                "Functional.rrelu", "Functional.dropout")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    work = tmp_path_factory.mktemp("random_apis")
    with Server(str(work)) as srv:
        for rank, dtype in ((0, "bfloat16"), (1, "float32")):
            cfg = agent_config(str(work / f"agent{rank}.json"), srv.port)
            run_training(TRAIN, cfg, dtype, env={"RANK": str(rank)}, timeout=240)
        srv.stop()
        assert "Traceback" not in srv.log()
        yield srv.out


@pytest.mark.parametrize("rank", [0, 1])
def test_no_error_rows_and_every_random_call_is_an_exact_pass(reports, rank):
    results = read_csv(reports, "accuracy_checking_result", rank)
    precision = read_csv(reports, "api_precision_compare_result", rank)
    assert results and len(results) == len(precision)
    for rows, key in ((results, "API name"), (precision, "API Name")):
        bad = [r for r in rows if "error" in (r["Forward Test Success"], r["Backward Test Success"])]
        assert not bad, bad[:5]
        for row in rows:
            statuses = (row["Forward Test Success"], row["Backward Test Success"])
            assert "SKIP" not in statuses or row["Message"], row          # every SKIP says why
            qualified = row[key].rsplit(".", 1)[0]
            if qualified in RANDOM_CALLS:
                assert row["Forward Test Success"] == "pass", row
                assert row["Backward Test Success"] in ("pass", " ", ""), row
            if qualified == "Torch.empty_like":
                assert row["Forward Test Success"] == "SKIP" and "uninitialised output" in row["Message"], row
    names = {r["API name"].rsplit(".", 1)[0] for r in results}
    assert set(RANDOM_CALLS) | {"Torch.empty_like"} <= names, names
    sdpa = [r for r in results if r["API name"].startswith("Functional.scaled_dot_product_attention.")]
    assert sdpa and all(r["Backward Test Success"] == "pass" for r in sdpa), sdpa


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdpa_keep_mask_is_recovered_from_the_kernel(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 12, 8, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 12, 8, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 12, 6, generator=g, dtype=dtype, requires_grad=True)
    torch.manual_seed(5)
    with capture() as (mode, sink):
        with mode:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True, enable_gqa=True)
        (y.float() * torch.linspace(0, 1, 6)).sum().backward()
    name = "Functional.scaled_dot_product_attention.0"
    fwd, bwd = to_job(sink.forward(name)), to_job(sink.backward(name))
    # the mask the kernel drew: the same generator state, weights taken directly from torch's math
    torch.set_rng_state(torch.frombuffer(bytearray(fwd.rng_state), dtype=torch.uint8))
    drawn = torch.empty(2, 4, 12, 12, dtype=dtype).bernoulli_(0.7).bool()
    keep = sdpa_keep_mask(fwd, CPU)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    assert torch.equal(keep & causal, drawn & causal)
    assert torch.equal(run_forward(fwd, CPU, bench=False), y.detach())           # the same-dtype run is exact
    bench = run_forward(fwd, CPU, bench=True)
    assert bench.dtype == (torch.float32 if dtype == torch.bfloat16 else torch.float64)
    tol = 0.05 if dtype == torch.bfloat16 else 1e-5
    assert (bench - y.detach().to(bench.dtype)).abs().max() < tol                 # same mask: only rounding apart
    for got, want in zip(run_backward(fwd, bwd, CPU, bench=True), bwd.grad_input):
        assert (got - want.to(got.dtype)).abs().max() < 4 * tol


def test_draws_are_replayed_in_the_recorded_dtype_and_are_their_own_bench():
    x = torch.randn(64)
    torch.manual_seed(2)
    with capture() as (mode, sink):
        with mode:
            a = torch.randn_like(x)
            b = x.clone().uniform_()
    for name, device in (("Torch.randn_like.0", a), ("Tensor.uniform_.0", b)):
        job = to_job(sink.forward(name))
        bench = run_forward(job, CPU, bench=True)
        assert bench.dtype == torch.float32 and torch.equal(bench, device), name


def test_random_calls_that_cannot_be_reproduced_are_skip_with_what_to_do():
    x = torch.randn(8, 8)
    with capture() as (mode, sink):
        with mode:
            F.rrelu(x, training=True)
            torch.empty_like(x)
    job = to_job(sink.forward("Functional.rrelu.0"))
    job.rng_device = "npu"
    with pytest.raises(ReplayError, match=r"same device type.*seed_all\(rm_dropout=True\)"):
        run_forward(job, CPU, bench=True)
    job.rng_state = b""
    with pytest.raises(ReplayError, match="no generator state"):
        run_forward(job, CPU, bench=True)
    with pytest.raises(ReplayError, match="uninitialised output"):
        run_forward(to_job(sink.forward("Torch.empty_like.0")), CPU, bench=True)


def _advances_generator(fn) -> bool:
    before = torch.get_rng_state()
    fn()
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    return not torch.equal(before, after)


def test_random_kind_matches_whether_the_call_draws():
    from protos.apis import random_kind

    x, q = torch.randn(4, 6), torch.randn(1, 2, 5, 4)
    cases = [
        ("Functional", "dropout", (x, 0.3, True), {}), ("Functional", "dropout", (x, 0.3, False), {}),
        ("Functional", "dropout", (x, 0.0), {}), ("Functional", "alpha_dropout", (x, 0.3), {}),
        ("Functional", "alpha_dropout", (x, 0.3, True), {}), ("Functional", "rrelu", (x,), {}),
        ("Functional", "rrelu", (x,), {"training": True}), ("Torch", "dropout", (x, 0.2, True), {}),
        ("Torch", "native_dropout", (x, 0.2, False), {}),
        ("Functional", "scaled_dot_product_attention", (q, q, q), {"dropout_p": 0.1}),
        ("Functional", "scaled_dot_product_attention", (q, q, q), {}),
        ("Torch", "randn_like", (x,), {}), ("Torch", "abs", (x,), {}),
    ]
    import torch.nn.functional as nnf

    for category, api, args, kwargs in cases:
        fn = getattr(nnf if category == "Functional" else torch, api)
        draws = _advances_generator(lambda: fn(*args, **kwargs))   # noqa: B023 - called at once
        assert (random_kind(category, api, args, kwargs) is not None) == draws, (category, api, args, kwargs)
