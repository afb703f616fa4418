"""Level-L1 capture (issue 2): names, filters, what is not a record, and that our failures never reach the training."""
import torch
import torch.nn.functional as F

from npu_agent import naming
from npu_agent.capture import CaptureMode, Capturer
from tests.support import ListSink


def _mode(sink, **kw):
    return CaptureMode(Capturer(sink.append, **kw))


def test_names_follow_msprobe_and_count_per_step():
    sink = ListSink()
    mode = _mode(sink)
    x, y, w = torch.randn(3, 4), torch.randn(3, 4), torch.randn(2, 4)
    with mode:
        x + y
        x.add(y)
        torch.add(x, y)
        F.linear(x, w)
        x.add_(1)
        _ = x.shape, x.size(), x.dim(), x.numel()      # metadata: no records
        x[0]
    assert sink.names() == ["Tensor.add.0", "Tensor.add.1", "Torch.add.0", "Functional.linear.0", "Tensor.add_.0",
                            "Tensor.__getitem__.0"]
    mode.capturer.next_step(1)
    with mode:
        F.linear(x, w)
    assert sink[-1].name == "Functional.linear.0" and sink[-1].step == 1


def test_backward_and_autograd_entry_points_are_not_records():
    sink = ListSink()
    x = torch.randn(3, requires_grad=True)
    with _mode(sink):
        y = (x * 2).sum()
        y.backward()
        torch.autograd.grad((x * 3).sum(), x)
    assert sink.names() == ["Tensor.mul.0", "Tensor.sum.0", "Tensor.mul.1", "Tensor.sum.1"]


def test_list_and_scope_filters():
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    sink = ListSink()
    with _mode(sink, api_list=("linear", "Tensor.relu", "Tensor.mul.1")):
        F.linear(x, w)
        x.relu()
        x * 2
        x * 3
        x + 1
    assert sink.names() == ["Functional.linear.0", "Tensor.relu.0", "Tensor.mul.1"]
    sink = ListSink()
    with _mode(sink, scope=("Tensor.mul.0", "Tensor.add.0")):
        F.linear(x, w)
        x * 2
        F.gelu(x)
        x + 1
        x - 1
    assert sink.names() == ["Tensor.mul.0", "Functional.gelu.0", "Tensor.add.0"]


def test_our_failures_never_reach_the_training(monkeypatch):
    x = torch.randn(4)

    def broken_sink(rec):
        raise RuntimeError("sink exploded")

    mode = CaptureMode(Capturer(broken_sink))
    with mode:
        y = torch.exp(x)
    assert torch.equal(y, torch.exp(x)) and mode.capturer.errors == 1

    def broken_classify(func):
        raise AttributeError("unexpected callable")

    monkeypatch.setattr(naming, "classify", broken_classify)
    sink = ListSink()
    mode = _mode(sink)
    with mode:
        z = torch.sin(x)
    assert torch.equal(z, torch.sin(x)) and not sink and mode.capturer.errors == 1


def test_the_callers_exceptions_pass_through_unchanged():
    sink = ListSink()
    try:
        with _mode(sink):
            torch.randn(2, 3) @ torch.randn(4, 5)
    except RuntimeError as exc:
        assert "cannot be multiplied" in str(exc)
    else:
        raise AssertionError("the shape error disappeared")


def test_in_place_inputs_are_snapshotted_before_the_call():
    sink = ListSink()
    x = torch.ones(3)
    with _mode(sink):
        x.mul_(5.0)
    (before, _), _ = sink.forward("Tensor.mul_.0").inputs.tree
    assert torch.equal(before, torch.ones(3)) and torch.equal(sink.forward("Tensor.mul_.0").output.tree, x)
