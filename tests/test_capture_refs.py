"""Capture holds references, copied only before a write (issue 13): whatever the training changes in place after a
call was captured (an in-place call, optimizer.step() on the parameters, zero_grad(set_to_none=False), a call that
writes its inputs without an in-place name), the record that goes out holds the values of the call. Each record is
compared, through the real wire encoding and the server's decoder, with a reference clone taken in the test."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from npu_agent.records import CHANGED_REASON
from npu_agent.snapshot import HELD
from tests.support import capture, to_job


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_in_place_call_after_capture_does_not_change_what_is_sent():
    x = torch.randn(4, 5)
    before = x.clone()
    with capture() as (mode, sink):
        with mode:
            y = x * 2
            copies = HELD.copied
            x.add_(1)                      # x is held by the mul record: copied before the write
            y.mul_(3)                      # so is the mul's output
            z = x.sum()
    assert HELD.copied >= copies + 2
    mul = to_job(sink.forward("Tensor.mul.0"))
    assert _same(mul.args[0], before) and _same(mul.output, before * 2)
    add = to_job(sink.forward("Tensor.add_.0"))
    assert _same(add.args[0], before) and _same(add.output, before + 1)
    mul_ = to_job(sink.forward("Tensor.mul_.0"))
    assert _same(mul_.args[0], before * 2) and _same(mul_.output, before * 6)
    assert _same(to_job(sink.forward("Tensor.sum.0")).output, z)


def test_optimizer_step_and_zero_grad_after_capture_do_not_change_what_is_sent():
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    w = nn.Parameter(torch.randn(6, 3))
    opt = torch.optim.SGD(list(lin.parameters()) + [w], lr=0.5, momentum=0.9)
    x = torch.randn(4, 6)
    w_before, bias_before = lin.weight.detach().clone(), lin.bias.detach().clone()
    with capture() as (mode, sink):
        with mode:
            wt = w.t()                              # its backward gradient becomes w.grad without a copy
            loss = (lin(x) * 2).sum() + (x @ wt.t()).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in (("weight", lin.weight), ("bias", lin.bias), ("w", w))}
        t_grad = sink.backward("Tensor.t.0").grad_output.tree[0]
        aliased = t_grad.untyped_storage().data_ptr() == w.grad.untyped_storage().data_ptr()
        held = [r() for r in HELD.pending.values() if r() is not None]
        opt.step()                                  # outside the mode, as in most training loops
        opt.zero_grad(set_to_none=False)            # zeroes the gradients in place
        lin.weight.grad.add_(1)
        w.grad.add_(1)
    assert aliased, "the test needs a captured gradient that is the storage of a parameter's .grad"
    assert held and not torch.equal(lin.weight, w_before)
    fwd = to_job(sink.forward("Functional.linear.0"))
    assert _same(fwd.args[0], x) and _same(fwd.args[1], w_before) and _same(fwd.args[2], bias_before)
    bwd = to_job(sink.backward("Functional.linear.0"))
    gw, gb = (bwd.grad_input[bwd.grad_input_positions.index(i)] for i in (1, 2))
    assert _same(gw, grads["weight"]) and _same(gb, grads["bias"])
    t_bwd = to_job(sink.backward("Tensor.t.0"))
    assert _same(t_bwd.grad_output[0], grads["w"].t()) and not t_bwd.skip_reason


def test_a_change_the_mode_did_not_see_is_never_sent():
    x = torch.randn(8)
    with capture() as (mode, sink):
        with mode:
            torch.exp(x)
    with torch.no_grad():
        x.mul_(0)                                   # no capture mode, no optimizer: nothing copies before this
    job = to_job(sink.forward("Torch.exp.0"))
    assert job.skip_reason == CHANGED_REASON and job.args == () and job.output is None


def test_calls_that_write_their_inputs_keep_the_values_before_the_call():
    x = torch.randn(8, 3)
    mean, var = torch.zeros(3), torch.ones(3)
    emb = torch.randn(10, 4) * 5
    idx = torch.tensor([1, 2, 3])
    emb_before = emb.clone()
    with capture() as (mode, sink):
        with mode:
            F.batch_norm(x, mean, var, training=True)          # updates the running statistics: copied before
            F.embedding(idx, emb, max_norm=1.0)                 # renormalises rows of emb: learned on the first call
            emb2_before = emb.clone()
            F.embedding(idx, emb, max_norm=0.5)
    bn = to_job(sink.forward("Functional.batch_norm.0"))
    assert _same(bn.args[1], torch.zeros(3)) and _same(bn.args[2], torch.ones(3)) and not bn.skip_reason
    assert not torch.equal(mean, torch.zeros(3))
    first = to_job(sink.forward("Functional.embedding.0"))
    assert "changed its own inputs" in first.skip_reason and not torch.equal(emb_before, emb2_before)
    second = to_job(sink.forward("Functional.embedding.1"))
    assert not second.skip_reason and _same(second.args[1], emb2_before) and not torch.equal(emb, emb2_before)


def test_views_are_sent_with_the_layout_of_a_private_copy():
    base = torch.randn(6, 9)
    sliced, transposed = base[:, :-1], base.t()          # a view into a larger storage; a dense permutation
    with capture() as (mode, sink):
        with mode:
            torch.add(sliced, 1)
            torch.mul(transposed, 2)
    add, mul = to_job(sink.forward("Torch.add.0")), to_job(sink.forward("Torch.mul.0"))
    assert _same(add.args[0], sliced) and add.args[0].is_contiguous()
    assert _same(mul.args[0], transposed) and mul.args[0].stride() == transposed.stride()


def test_a_writer_lists_nothing_where_no_reference_is_left():
    """HELD.protect (the optimizer's step, zero_grad, a write the mode sees) asks first whether a pending snapshot
    still holds a tensor by reference: where each is gone or has its copy, the tensors to be written are not even
    listed; where one is held, it gets its copy as before."""
    from npu_agent.snapshot import HeldRefs, snapshot

    def never():
        raise AssertionError("the tensors were listed")
        yield

    held = HeldRefs()
    x = torch.randn(3)
    snap = snapshot(x)
    held.add(snap)
    assert held.uncopied()
    assert held.protect([x]) == 1 and not held.uncopied()   # copied: nothing left by reference
    assert held.protect(never()) == 0
    gone = snapshot(torch.randn(2))
    held.add(gone)
    del gone
    assert held.pending and not held.uncopied() and len(held.pending) == 1   # the gone one forgotten on the way
    assert held.protect(never()) == 0
