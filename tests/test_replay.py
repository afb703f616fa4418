"""Replay on the bench host (issues 2, 3): upcast rules, autocast, random APIs, in-place calls."""
import pytest
import torch
import torch.nn.functional as F

from gpu_server.replay.run import ReplayError, run_backward, run_forward, upcast_plan
from tests.support import capture, to_job

CPU = torch.device("cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t


def test_upcast_rules():
    f16, bf16, f32 = (torch.zeros(1, dtype=d) for d in (torch.float16, torch.bfloat16, torch.float32))
    assert upcast_plan([f16])[torch.float16] == torch.float32
    assert upcast_plan([f32])[torch.float32] == torch.float64
    mixed = upcast_plan([bf16, f32])
    assert mixed[torch.bfloat16] == torch.float32 and torch.float32 not in mixed  # mixed calls all run in float32


def test_bench_run_is_upcast_and_never_autocast():
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    with capture() as (mode, sink):
        with mode:
            F.linear(x, w)
    job = to_job(sink.forward("Functional.linear.0"))
    bench = run_forward(job, CPU, bench=True)
    assert bench.dtype == torch.float32
    assert torch.equal(bench, F.linear(x.float(), w.float()))
    assert torch.equal(_bits(run_forward(job, CPU, bench=False)), _bits(F.linear(x, w)))


def test_autocast_call_is_replayed_with_the_inputs_the_device_computed_with():
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with capture() as (mode, sink):
        with mode, torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        (y.float() * torch.arange(8.0)).sum().backward()
    rec = sink.forward("Functional.linear.0")
    assert rec.autocast == (True, "bfloat16", "cpu") and y.dtype == torch.bfloat16
    fwd, bwd = to_job(rec), to_job(sink.backward("Functional.linear.0"))
    # same-dtype run: under the recorded autocast, bit for bit
    assert torch.equal(_bits(run_forward(fwd, CPU, bench=False)), _bits(y.detach()))
    same_grads = run_backward(fwd, bwd, CPU, bench=False)
    for got, want in zip(same_grads, bwd.grad_input):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # bench run: the float32 inputs rounded to bfloat16 as autocast did, then computed in float32
    bench = run_forward(fwd, CPU, bench=True)
    expect = F.linear(x.detach().bfloat16().float(), lin.weight.detach().bfloat16().float(),
                      lin.bias.detach().bfloat16().float())
    assert bench.dtype == torch.float32 and torch.allclose(bench, expect, rtol=0, atol=1e-6)
    assert (bench - y.float()).abs().max() < 0.05


def test_random_api_replayed_from_generator_state_on_the_same_device_type():
    x = torch.empty(1000)
    torch.manual_seed(3)
    with capture() as (mode, sink):
        with mode:
            a = torch.rand(50)
            x.uniform_(-1, 1)
            b = torch.bernoulli(torch.full((40,), 0.3))
    for name, device_out in (("Torch.rand.0", a), ("Tensor.uniform_.0", x), ("Torch.bernoulli.0", b)):
        job = to_job(sink.forward(name))
        assert job.rng_device == "cpu" and job.rng_state
        assert torch.equal(run_forward(job, CPU, bench=False), device_out), name
    job = to_job(sink.forward("Torch.rand.0"))
    job.rng_device = "npu"
    with pytest.raises(ReplayError, match="same device type"):
        run_forward(job, CPU, bench=True)


def test_inplace_replay_uses_private_copies_and_values_before_the_call():
    x = torch.randn(5)
    with capture() as (mode, sink):
        with mode:
            x.mul_(3.0)
            x.add_(1.0)
    job = to_job(sink.forward("Tensor.add_.0"))
    before = job.args[0].clone()
    out = run_forward(job, CPU, bench=False)
    assert torch.equal(out, x) and torch.equal(job.args[0], before)   # the recorded input was not modified


def test_opaque_argument_is_a_skip_with_the_type_named():
    class Thing:
        pass

    with capture() as (mode, sink):
        with mode:
            torch.add(torch.ones(2), 1, alpha=1)
    rec = sink.forward("Torch.add.0")
    rec.inputs.tree = ((rec.inputs.tree[0][0], Thing()), {})
    with pytest.raises(ReplayError, match="Thing"):
        run_forward(to_job(rec), CPU, bench=True)


def test_device_names_given_as_strings_become_the_bench_device():
    x = torch.randn(3)
    with capture() as (mode, sink):
        with mode:
            x.to("cpu", torch.float16)
    rec = sink.forward("Tensor.to.0")
    rec.inputs.tree = ((rec.inputs.tree[0][0], "npu:0", torch.float16), {})   # as a training on an NPU records it
    out = run_forward(to_job(rec), CPU, bench=False)
    assert out.device.type == "cpu" and torch.equal(out, x.to(torch.float16))


def test_the_meta_dry_run_is_remembered_per_call_signature(monkeypatch):
    from gpu_server.replay import run as replay

    replay._META_SIZES.clear()
    runs = []
    dry_run = replay._meta_elements
    monkeypatch.setattr(replay, "_meta_elements", lambda job: runs.append(job.api) or dry_run(job))
    with capture() as (mode, sink):
        with mode:
            for _ in range(2):   # the same call site with other values: one dry run
                F.linear(torch.randn(4, 8), torch.randn(3, 8))
            F.linear(torch.randn(5, 8), torch.randn(3, 8))   # another shape: its own
            torch.zeros(4)
            torch.zeros(4)
    for name in ("Functional.linear.0", "Functional.linear.1", "Functional.linear.2"):
        replay.allocation_check(to_job(sink.forward(name)))
    assert runs == ["linear", "linear"]
    # a greedy call: refused, then refused again from what was remembered (each record's own output is what the
    # verdict compares with)
    for name in ("Torch.zeros.0", "Torch.zeros.1"):
        greedy = sink.forward(name)
        greedy.inputs.tree = (((1 << 40,),), {})
        with pytest.raises(ReplayError, match="would produce"):
            replay.allocation_check(to_job(greedy))
    assert runs == ["linear", "linear", "zeros"]
