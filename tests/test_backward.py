"""Backward records per API call (issue 3): the recorded grad_input is exactly this call's gradient."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

from gpu_server.replay.run import run_backward, run_forward
from tests.support import capture, to_job

torch.manual_seed(0)


def _grad_of(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, grad_out)


def test_linear_grad_input_with_residual_equals_autograd():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            y = F.linear(x, w, b) + x          # x is used by the call and by the residual
            loss = (y * y).sum()
        loss.backward()
    fwd, bwd = sink.forward("Functional.linear.0"), sink.backward("Functional.linear.0")
    (xs, ws, bs), _ = fwd.inputs.tree
    expect = _grad_of(F.linear, (xs, ws, bs), bwd.grad_output.tree[0])
    got = bwd.grad_input.tree
    assert bwd.grad_input_positions == (0, 1, 2)
    assert all(torch.equal(e, g) for e, g in zip(expect, got))
    # x's total gradient differs from the call's own grad_input: the residual contributed too
    assert not torch.equal(x.grad, got[0])


def test_square_by_mul_gives_two_taps_each_half():
    y = torch.randn(5, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            z = (y * y).sum()
        z.backward()
    bwd = sink.backward("Tensor.mul.0")
    g_a, g_b = bwd.grad_input.tree
    assert torch.equal(g_a, g_b)
    assert torch.allclose(g_a + g_b, y.grad)
    assert torch.allclose(g_a, y.detach())  # d(sum(a*b))/da = b = y


def test_tied_embedding_and_head_weights():
    emb = nn.Embedding(11, 6)
    idx = torch.randint(0, 11, (3, 4))
    with capture() as (mode, sink):
        with mode:
            h = emb(idx)
            logits = F.linear(h, emb.weight)
            loss = logits.logsumexp(-1).sum()
        loss.backward()
    e_fwd, e_bwd = sink.forward("Functional.embedding.0"), sink.backward("Functional.embedding.0")
    (i_s, w_s), kw = e_fwd.inputs.tree
    expect = _grad_of(lambda w: F.embedding(i_s, w, **kw), (w_s,), e_bwd.grad_output.tree[0])
    assert torch.equal(e_bwd.grad_input.tree[0], expect[0])
    l_bwd = sink.backward("Functional.linear.0")
    total = e_bwd.grad_input.tree[0] + l_bwd.grad_input.tree[1]
    assert torch.allclose(total, emb.weight.grad, atol=1e-6)


def test_inplace_on_non_leaf_records_gradient_of_the_value_read():
    x = torch.randn(6, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            h = x * 3.0
            h.mul_(2.0)
            h.add_(x)
            loss = h.pow(2).sum()
        loss.backward()
    mul_ = sink.backward("Tensor.mul_.0")
    # grad w.r.t. the old h is 2 * grad w.r.t. the new h
    assert torch.equal(mul_.grad_input.tree[0], 2.0 * mul_.grad_output.tree[0])
    assert sink.forward("Tensor.mul_.0").inplace
    # the forward snapshot holds the value before the call (x * 3), not after
    (h_before, _), _ = sink.forward("Tensor.mul_.0").inputs.tree
    assert torch.equal(h_before, x.detach() * 3.0)


def test_split_has_one_backward_record_with_each_output_gradient():
    x = torch.randn(4, 6, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            a, b, c = x.split(2, dim=1)
            loss = (a * 1.0).sum() + (c * 2.0).sum()
        loss.backward()
    bwd = [r for r in sink if r.name == "Tensor.split.0" and r.direction == 2]
    assert len(bwd) == 1
    g_a, g_b, g_c = bwd[0].grad_output.tree
    assert torch.equal(g_a, torch.ones(4, 2)) and g_b is None and torch.equal(g_c, torch.full((4, 2), 2.0))
    assert torch.equal(bwd[0].grad_input.tree[0], x.grad)


def _ckpt_run(reentrant: bool):
    torch.manual_seed(1)
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            h = ckpt.checkpoint(lambda t: F.gelu(lin1(t)) + t, x, use_reentrant=reentrant)
            loss = lin2(h).sum()
        loss.backward()
    return sink


def test_checkpoint_both_variants_no_duplicates_and_backward_present():
    for reentrant in (True, False):
        sink = _ckpt_run(reentrant)
        fwd = sink.names(1)
        assert len(fwd) == len(set(fwd)), (reentrant, fwd)
        assert fwd.count("Functional.linear.0") == 1 and fwd.count("Functional.gelu.0") == 1
        bwd = set(sink.names(2))
        assert {"Functional.linear.0", "Functional.linear.1", "Functional.gelu.0", "Tensor.add.0"} <= bwd, \
            (reentrant, bwd)
        for name in ("Functional.linear.0", "Functional.gelu.0"):
            assert sink.forward(name).backward_expected


def test_dropout_replay_is_exact_forward_and_backward_in_device_dtype():
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    torch.manual_seed(123)
    with capture() as (mode, sink):
        with mode:
            y = F.dropout(x, 0.3, training=True)
            loss = (y.float() * torch.linspace(0, 1, 32)).sum()
        loss.backward()
    fwd, bwd = to_job(sink.forward("Functional.dropout.0")), to_job(sink.backward("Functional.dropout.0"))
    assert fwd.mask is not None and fwd.mask.dtype == torch.bool
    same = run_forward(fwd, torch.device("cpu"), bench=False)
    assert torch.equal(same.view(torch.int16), y.detach().view(torch.int16))
    grads = run_backward(fwd, bwd, torch.device("cpu"), bench=False)
    assert torch.equal(grads[0].view(torch.int16), x.grad.view(torch.int16))
    # the mask is the true keep-mask, also where the input was zero
    assert torch.equal(fwd.mask, y.detach() != 0) or bool(((x == 0) & fwd.mask).any())


def test_dropout_capture_does_not_consume_the_random_stream():
    x = torch.randn(100)
    torch.manual_seed(7)
    F.dropout(x, 0.5)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    with capture() as (mode, _):
        with mode:
            F.dropout(x, 0.5)
    assert torch.equal(torch.rand(3), expected_next)


def test_no_backward_records_under_no_grad_and_for_non_differentiable_outputs():
    x = torch.randn(4, 4, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            with torch.no_grad():
                F.relu(x)
            x.argmax()
            loss = x.sum()
        loss.backward()
    assert not sink.forward("Functional.relu.0").backward_expected
    assert not sink.forward("Tensor.argmax.0").backward_expected
    assert sink.names(2) == ["Tensor.sum.0"]


def test_compiled_region_is_opaque_and_not_recompiled_per_step():
    import torch._dynamo

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()

    @torch.compile(backend="inductor")
    def f(a):
        return torch.sin(a) * 2 + 1

    a = torch.randn(8)
    with capture(backward=False) as (mode, sink):
        for _ in range(4):          # capture on and off, as a training loop's start/stop does
            with mode:
                f(a)
            f(a)
    frames = counters["stats"]["unique_graphs"]
    assert frames <= 2, counters["stats"]
    assert not [n for n in sink.names(1) if "sin" in n]
