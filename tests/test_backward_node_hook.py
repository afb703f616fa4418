"""Backward taps with one hook per call (issue 25 goal 2): a call whose output's autograd node has only the call's
aliases as inputs gets one hook after that node (grad_output and every grad_input at once) in place of a pre-hook
per tensor. Its records must be exactly those of the per-tensor hooks, in the same order; any other call (a
composite whose inner node also reads an input, several outputs, an in-place call) keeps the per-tensor hooks."""
import pytest
import torch
import torch.nn.functional as F

from examples.demo import TinyLM, batches
from npu_agent import backward
from npu_agent.records import encode_record
from tests.support import capture, to_job


def _records(dtype: torch.dtype) -> list[tuple]:
    """Three TinyLM steps (dropout on), every record encoded for the wire: (name, direction, header, payload)."""
    torch.manual_seed(0)
    model = TinyLM(vocab=96, d=32, heads=4, layers=2, seq=16, dropout=0.1).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: list[tuple] = []
    with capture() as (mode, sink):
        for step, (idx, tgt) in enumerate(batches(3, batch=4, seq=16, vocab=96)):
            with mode:
                loss = model(idx, tgt)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mode.capturer.backward.end_step()
            mode.capturer.next_step(step + 1)
            for rec in sink:
                rec.seq = len(out)
                enc = encode_record(rec, "run", 0)
                head = enc.record
                out.append((rec.name, rec.direction, head.SerializeToString(),
                            b"".join(bytes(f) for f in enc.wire_frames(1 << 30))))
            sink.clear()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_hook_per_call_gives_the_records_of_a_hook_per_tensor(monkeypatch, dtype):
    hooked: list[bool] = []
    real = backward._direct_edges

    def spy(fn, nodes, slots):
        edges = real(fn, nodes, slots)
        hooked.append(edges is not None)
        return edges

    monkeypatch.setattr(backward, "ALIAS_FREE", False)   # every call through its aliases: _direct_edges decides
    with monkeypatch.context() as m:
        m.setattr(backward, "_direct_edges", spy)
        fast = _records(dtype)
    assert sum(hooked) > len(hooked) // 2 and not all(hooked)   # both kinds of call were met
    with monkeypatch.context() as m:
        m.setattr(backward, "_direct_edges", lambda fn, nodes, slots: None)   # a pre-hook per tensor
        slow = _records(dtype)
    assert [r[:2] for r in fast] == [r[:2] for r in slow]
    assert sum(r[1] == 2 for r in fast) > 40   # the backward records are there ...
    assert fast == slow                         # ... byte for byte, in the same order


def test_an_input_also_read_by_an_inner_node_keeps_its_whole_gradient():
    """F.normalize(x) = x / norm(x): the output's node reads x directly and through the norm. The call's grad_input
    is the sum of both, which only a hook on x's alias sees."""
    x = (torch.randn(4, 6) * 3).requires_grad_(True)
    with capture() as (mode, sink):
        with mode:
            y = F.normalize(x, dim=-1)
            loss = (y * torch.arange(6.0)).sum()
        loss.backward()
    bwd = to_job(sink.backward("Functional.normalize.0"))
    expect = torch.autograd.grad((F.normalize(x, dim=-1) * torch.arange(6.0)).sum(), x)[0]
    assert torch.equal(bwd.grad_input[0], expect)
    assert torch.equal(x.grad, expect)


def test_a_single_node_call_gets_one_hook_and_exact_gradients(monkeypatch):
    """torch.mul(x, w): one node whose inputs are the two aliases; grad_input is autograd's, also when x is used
    elsewhere (the residual), and the parameter's gradient is a copy (later steps change .grad in place)."""
    x = torch.randn(4, 8, requires_grad=True) * 1
    w = torch.randn(4, 8, requires_grad=True)
    hooked: list[object] = []
    real = backward._direct_edges
    monkeypatch.setattr(backward, "_direct_edges", lambda *a: hooked.append(real(*a)) or hooked[-1])
    with capture() as (mode, sink):
        with mode:
            y = torch.mul(x, w) + x
            loss = (y * y).sum()
        loss.backward()
    assert hooked[0] is not None and sorted(slot for _, slot in hooked[0]) == [0, 1]
    fwd, bwd = sink.forward("Torch.mul.0"), sink.backward("Torch.mul.0")
    (xs, ws), _ = fwd.inputs.tree
    leaves = [t.detach().clone().requires_grad_(True) for t in (xs, ws)]
    expect = torch.autograd.grad(torch.mul(*leaves), leaves, bwd.grad_output.tree[0])
    assert bwd.grad_input_positions == (0, 1)
    assert all(torch.equal(e, g) for e, g in zip(expect, bwd.grad_input.tree))
    assert torch.equal(bwd.grad_output.tree[0], 2 * y.detach())
    assert bwd.grad_input.tree[1] is not w.grad
    w.grad.mul_(0)
    assert torch.equal(bwd.grad_input.tree[1], expect[1])


def test_retain_graph_second_backward_keeps_the_first_gradients():
    x = torch.randn(3, 5, requires_grad=True)
    w = torch.randn(5, 5, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            y = torch.matmul(x, w)
            loss = y.square().sum()
        loss.backward(retain_graph=True)
        first = [g.clone() for g in sink.backward("Torch.matmul.0").grad_input.tree]
        (loss * 3).backward()
    bwds = [r for r in sink if r.name == "Torch.matmul.0" and r.direction == 2]
    assert len(bwds) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, bwds[0].grad_input.tree))


def test_a_nested_argument_after_a_tapped_tensor_taps_each_tensor_once():
    """index_put_(x, (idx,), v): x (in place, a tensor hook) comes before the tuple of indices, which sends the call to
    the walk for nested arguments; the taps begun before it are dropped, so one backward record, exact gradients."""
    base = torch.randn(5, 3, requires_grad=True)
    v = torch.randn(2, 3, requires_grad=True)
    idx = torch.tensor([0, 3])
    with capture() as (mode, sink):
        with mode:
            x = base * 2
            x.index_put_((idx,), v)
            loss = (x * torch.arange(3.0)).sum()
        loss.backward()
    bwds = [r for r in sink if r.name == "Tensor.index_put_.0" and r.direction == 2]
    assert len(bwds) == 1
    grads = dict(zip(bwds[0].grad_input_positions, bwds[0].grad_input.tree))
    weight = torch.arange(3.0).expand(5, 3)
    x_expect = weight.clone()
    x_expect[idx] = 0                                    # the rows the write replaced had no effect on the loss
    assert torch.equal(grads[0], x_expect)
    assert torch.equal(grads[max(grads)], weight[:2])    # v's rows, where the loss weighs them
