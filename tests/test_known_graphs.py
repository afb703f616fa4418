"""Calls tapped without aliases (issue 25 goal 2): a call whose signature (the API, each argument's kind, each tensor's
dtype, dimensions and whether it is tapped) made one autograd node straight on its aliases before is given no
aliases; its node's edges are checked against its own tensors and hooked as before (npu_agent/backward.py,
`BackwardTaps.known`). Its records must be exactly those the aliases give, and a call whose graph is not the one
its signature made must be told, not guessed."""
import logging

import pytest
import torch
import torch.nn.functional as F

from npu_agent import backward
from tests.support import capture, to_job
from tests.test_backward_node_hook import _records


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_records_without_aliases_are_those_with_aliases(monkeypatch, dtype):
    """Three TinyLM steps (dropout, layer norms, attention, residuals, tied nothing): every record byte for byte
    what aliases on every call give, with most calls after the first step tapped without aliases."""
    checked: list[bool] = []
    real = backward._Known.hooks_of
    monkeypatch.setattr(backward._Known, "hooks_of", lambda self, fn, leaf: checked.append(
        real(self, fn, leaf) is not None) or real(self, fn, leaf))
    free = _records(dtype)
    assert len(checked) > 60 and all(checked)   # the calls of steps 2 and 3 that the first step made known
    monkeypatch.setattr(backward, "ALIAS_FREE", False)
    checked.clear()
    aliased = _records(dtype)
    assert not checked
    assert [r[:2] for r in free] == [r[:2] for r in aliased]
    assert free == aliased


def _mul_twice(make, tamper=None, third=False):
    """torch.mul(x, w) + x, squared and summed, in two (or three) steps, (x, w) = make() in each: the first step
    makes the signature known, `tamper(taps)` may then change what is known. Returns the sink, the taps and each
    step's output."""
    steps = []
    with capture() as (mode, sink):
        taps = mode.capturer.backward
        for step in range(3 if third else 2):
            if step == 1 and tamper is not None:
                tamper(taps)
            x, w = make()
            with mode:
                y = torch.mul(x, w) + x
                loss = (y * y).sum()
            loss.backward()
            taps.end_step()
            mode.capturer.next_step(step + 1)
            steps.append(y)
    return sink, taps, steps


def _tamper(change):
    """A `tamper` for _mul_twice: torch.mul's known node (edge count, the edges not None, its input edges) as
    `change(count, edges)` gives them."""
    def tamper(taps):
        for sig, ((parent, j, size, count, edges),) in list(taps.known.items()):
            if sig[:2] == ("Torch", "mul"):
                taps.known[sig] = ((parent, j, size, *change(count, edges)),)
    return tamper


_SWAP = _tamper(lambda count, edges: (count, tuple((i, 1 - slot) for i, slot in edges)))   # the slots swapped
_FORGET = _tamper(lambda count, edges: (count - 1, edges[:1]))                                # an edge forgotten


def _record(sink, step, direction):
    """The record of step `step`'s torch.mul (every step names it Torch.mul.0)."""
    return next(r for r in sink if r.name == "Torch.mul.0" and r.step == step and r.direction == direction)


def _exact(sink, step):
    fwd, bwd = _record(sink, step, 1), _record(sink, step, 2)
    (xs, ws), _ = fwd.inputs.tree
    leaves = [t.detach().clone().requires_grad_(True) for t in (xs, ws)]
    expect = torch.autograd.grad(torch.mul(*leaves), leaves, bwd.grad_output.tree[0])
    assert bwd.grad_input_positions == (0, 1)
    assert all(torch.equal(e, g) for e, g in zip(expect, bwd.grad_input.tree)), step


def test_a_known_call_takes_its_own_tensors_and_gets_exact_gradients():
    """The second torch.mul(x, w) is given x and w themselves (its node's edges lead to x's node and w's
    AccumulateGrad, no alias between), and its record holds autograd's gradients, the parameter's a copy."""
    base = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    xs = []
    seen = []
    first_step = []
    real = torch.Tensor.view_as
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, "view_as", lambda self, other: seen.append(self) or real(self, other))
        sink, taps, _ = _mul_twice(lambda: (xs.append(base * 1) or xs[-1], w),
                                   lambda taps: first_step.append(len(seen)))
    assert len(taps.known) == 4   # torch.mul, the add, the square's mul, the sum
    assert [t is xs[0] for t in seen[:2]] == [True, False] and first_step == [len(seen)]   # no alias in step 2
    _exact(sink, 0)
    _exact(sink, 1)
    second = _record(sink, 1, 2).grad_input.tree[1]
    assert second is not w.grad and torch.equal(second, w.grad / 2)   # two steps accumulated into .grad


def test_a_call_whose_graph_is_not_the_known_one_is_told_and_aliased_after(monkeypatch, caplog):
    """What the signature made known is changed (its two edges swapped): the second call's edges do not lead to its
    inputs as known, so its record comes without input gradients, a warning names the call, and the third call takes
    aliases again, with exact gradients."""
    base = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)

    with caplog.at_level(logging.WARNING, logger="npu_agent"):
        sink, taps, _ = _mul_twice(lambda: (base * 1, w), _SWAP, third=True)
    assert [r for r in caplog.records if "Torch.mul.0 (step 1)" in r.getMessage()]
    assert [sig[:2] for sig in taps.mixed] == [("Torch", "mul")]
    assert ("Torch", "mul") not in [sig[:2] for sig in taps.known]
    assert not to_job(_record(sink, 1, 2)).grad_input
    _exact(sink, 0)
    _exact(sink, 2)


def test_two_parameters_swapped_are_caught_by_their_accumulators():
    """torch.mul(w1, w2), both leaves: edges that lead to each other's AccumulateGrad do not pass for theirs."""
    w1 = torch.randn(3, 5, requires_grad=True)
    w2 = torch.randn(3, 5, requires_grad=True)

    sink, taps, _ = _mul_twice(lambda: (w1, w2), _SWAP)
    assert [sig[:2] for sig in taps.mixed] == [("Torch", "mul")]
    assert not to_job(_record(sink, 1, 2)).grad_input


def test_an_edge_the_known_graph_did_not_have_is_caught():
    """Known with one of its two edges forgotten: the second call's node has an input edge the known graph does
    not account for, so it is not taken for known."""
    base = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)

    sink, taps, _ = _mul_twice(lambda: (base * 1, w), _FORGET)
    assert [sig[:2] for sig in taps.mixed] == [("Torch", "mul")]


def test_arguments_that_choose_another_graph_make_another_signature(caplog):
    """x.to(float64) makes a node on x; x.to(float32) of a float32 x returns x itself. The dtype is part of the
    signature, so neither call is taken for the other: no warning, and each gets the record aliases give."""
    base = torch.randn(3, 4, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="npu_agent"):
        with capture() as (mode, sink):
            taps = mode.capturer.backward
            for step in range(2):
                x = base * 1
                with mode:
                    a = x.to(torch.float64)
                    b = x.to(torch.float32)
                    loss = a.sum() + (b * b).sum()
                loss.backward()
                taps.end_step()
                mode.capturer.next_step(step + 1)
    assert not [r for r in caplog.records if "autograd graph" in r.getMessage()]
    to = [sig for sig in (*taps.known, *taps.mixed) if sig[:2] == ("Tensor", "to")]
    assert len(to) == 2   # float64: a node on x, known; float32: x itself, nothing to learn (aliases always)
    assert [torch.float64 in sig for sig in taps.known if sig[:2] == ("Tensor", "to")] == [True]
    assert len(taps.known) >= 2
    for step in (0, 1):
        to64 = next(r for r in sink if r.name == "Tensor.to.0" and r.step == step and r.direction == 2)
        assert torch.equal(to_job(to64).grad_input[0], torch.ones(3, 4))


def _steps(fn, steps=2):
    """fn() in the mode, then its sum's backward, `steps` times; the sink, the taps and the view_as calls made in the
    first step and after it."""
    seen: list[int] = []
    calls = [0]
    real = torch.Tensor.view_as

    def counting(self, other):
        calls[0] += 1
        return real(self, other)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, "view_as", counting)
        with capture() as (mode, sink):
            taps = mode.capturer.backward
            for step in range(steps):
                with mode:
                    loss = fn().square().sum()
                loss.backward()
                taps.end_step()
                mode.capturer.next_step(step + 1)
                seen.append(calls[0])
    return sink, taps, seen


def test_a_linear_on_a_3d_input_is_known_through_its_inner_nodes():
    """F.linear(x, w, b) on a 3-D x is a view of an addmm whose edges go through a view of x and a transpose of w:
    the second call is given no aliases, its input gradients are taken after those inner nodes, and they are
    autograd's, with grad_output the view's."""
    base = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    sink, taps, seen = _steps(lambda: F.linear(base * 1, w, b))
    linear = [tree for sig, tree in taps.known.items() if sig[:2] == ("Functional", "linear")]
    assert len(linear) == 1 and len(linear[0]) > 1   # an inner node or more below the output's
    assert seen[1] == seen[0]   # no alias in the second step
    for step in (0, 1):
        fwd = next(r for r in sink if r.name == "Functional.linear.0" and r.step == step and r.direction == 1)
        bwd = next(r for r in sink if r.name == "Functional.linear.0" and r.step == step and r.direction == 2)
        leaves = [t.detach().clone().requires_grad_(True) for t in fwd.inputs.tree[0]]
        grad_out = bwd.grad_output.tree[0]
        assert grad_out.shape == (2, 3, 5)
        expect = torch.autograd.grad(F.linear(*leaves), leaves, grad_out)
        assert bwd.grad_input_positions == (0, 1, 2)
        assert all(torch.equal(e, g) for e, g in zip(expect, bwd.grad_input.tree)), step


def test_an_input_read_twice_inside_a_call_keeps_its_alias():
    """F.normalize(x) reads x twice (x / norm(x)): no one edge carries the call's whole gradient for x, so its
    signature is not learned and every call takes an alias, with exact gradients."""
    base = torch.randn(4, 6, requires_grad=True)
    sink, taps, seen = _steps(lambda: F.normalize(base * 3, dim=-1))
    assert not [sig for sig in taps.known if sig[:2] == ("Functional", "normalize")]
    assert seen[1] > seen[0]   # an alias in the second step too
    for step in (0, 1):
        fwd = next(r for r in sink if r.name == "Functional.normalize.0" and r.step == step and r.direction == 1)
        bwd = next(r for r in sink if r.name == "Functional.normalize.0" and r.step == step and r.direction == 2)
        x = fwd.inputs.tree[0][0].detach().clone().requires_grad_(True)
        expect = torch.autograd.grad(F.normalize(x, dim=-1), x, bwd.grad_output.tree[0])[0]
        assert torch.equal(bwd.grad_input.tree[0], expect)


def test_a_known_call_that_returns_several_outputs_is_told_and_its_outputs_hooked(caplog):
    """A call of a known signature that returns a tuple is not the known graph: a warning names it, its signature
    takes aliases from then on, and its outputs' gradients still make its backward record (without input
    gradients, as for any call whose graph is not the known one)."""
    from npu_agent.capture import CallContext
    from npu_agent.records import PendingRecord

    base = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    sink, taps, _ = _mul_twice(lambda: (base * 1, w))
    sig = next(sig for sig in taps.known if sig[:2] == ("Torch", "mul"))
    x = base * 1
    rec = PendingRecord(name="Torch.mul.0", step=2, grad_enabled=True, autocast=sig[2])
    ctx = CallContext(rec, "Torch", "mul", (x, w), {})
    taps.tap_inputs(ctx)
    assert ctx.args[0] is x and type(ctx.taps[2]) is backward._Known   # known: no alias
    y = torch.mul(x, w)
    with caplog.at_level(logging.WARNING, logger="npu_agent"):
        out = taps.tap_outputs(ctx, (y, y * 2))
    assert [r for r in caplog.records if "Torch.mul.0 (step 2)" in r.getMessage()]
    assert sig in taps.mixed and sig not in taps.known and rec.backward_expected
    (out[0] + out[1]).sum().backward()
    taps.end_step()
    bwd = next(r for r in sink if r.name == "Torch.mul.0" and r.step == 2 and r.direction == 2)
    assert not to_job(bwd).grad_input


def test_each_signature_walks_its_nodes_once(monkeypatch):
    """x.contiguous() of a contiguous x returns x itself: nothing to learn, so its signature takes aliases; neither
    it nor the known ones (the product, the square, the sum) walk their nodes again in later steps."""
    walks = []
    real = backward._tree_of
    monkeypatch.setattr(backward, "_tree_of", lambda *a: walks.append(a) or real(*a))
    base = torch.randn(4, 6, requires_grad=True)
    sink, taps, _ = _steps(lambda: (base * 2).contiguous(), steps=3)
    assert [sig[:2] for sig in taps.mixed] == [("Tensor", "contiguous")]
    assert len(taps.known) == 3 and len(walks) == 4   # one walk each, in the first step
