"""One test per private torch API in protos/torch_compat.py, exercised the way its caller relies on it. A failure
here after a torch upgrade names the torch version and the function to adapt; nothing else needs reading."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

from protos import torch_compat


def changed(what: str) -> str:
    return (f"torch {torch.__version__} changed {what}: adapt protos/torch_compat.py (and only it) to this release, "
            "or pin torch to the last release this test passed with")


class Recording(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_function_mode_stack():
    outer, inner = Recording(), Recording()
    try:
        before = torch_compat.function_mode_stack()
        with outer, inner:
            stack = torch_compat.function_mode_stack()
            assert stack[-2:] == [outer, inner], changed("torch.overrides._get_current_function_mode_stack()")
        assert torch_compat.function_mode_stack() == before, changed("the function mode stack after exit")
    except AttributeError as exc:
        pytest.fail(changed(f"the function mode stack ({exc})"))


def test_in_backward_pass():
    seen: list[bool] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(torch_compat.in_backward_pass()))

    class Custom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            seen.append(torch_compat.in_backward_pass())
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(torch_compat.in_backward_pass())
            return g

    try:
        assert not torch_compat.in_backward_pass(), changed("torch._C._current_graph_task_id() outside backward")
        Custom.apply(y).sum().backward()
    except AttributeError as exc:
        pytest.fail(changed(f"torch._C._current_graph_task_id ({exc})"))
    assert seen == [False, True, True], changed(f"torch._C._current_graph_task_id() in forward/backward: {seen}")


def test_disable_torch_function():
    mode = Recording()
    x = torch.ones(2)
    try:
        with mode:
            with torch_compat.disable_torch_function():
                copy = x.detach().clone()
            x.add(1)
    except AttributeError as exc:
        pytest.fail(changed(f"torch._C.DisableTorchFunction ({exc})"))
    assert torch.equal(copy, x)
    assert mode.seen == ["add"], changed(f"torch._C.DisableTorchFunction (the mode saw {mode.seen})")


def test_queue_backward_callback():
    events: list[str] = []
    x = torch.ones(2, requires_grad=True)
    a, b = x * 2, x * 3

    def hook(name):
        def run(g):
            events.append(name)
            if name == "a":
                torch_compat.queue_backward_callback(lambda: events.append("end of backward"))
        return run

    a.register_hook(hook("a"))
    b.register_hook(hook("b"))
    try:
        (a.sum() + b.sum()).backward()
    except AttributeError as exc:
        pytest.fail(changed(f"Variable._execution_engine.queue_callback ({exc})"))
    events.append("backward returned")
    assert sorted(events[:2]) == ["a", "b"] and events[2:] == ["end of backward", "backward returned"], \
        changed(f"when queue_callback's callback runs: {events}")
    # the agent catches RuntimeError when it is called outside a backward pass (nothing to queue on)
    with pytest.raises(RuntimeError):
        torch_compat.queue_backward_callback(lambda: None)


def test_op_overload_name():
    cases = {torch.ops.aten.add.Tensor: ("aten", "add"), torch.ops.aten.add: ("aten", "add"),
             torch.ops.aten.native_layer_norm.default: ("aten", "native_layer_norm"),
             torch.ops.aten.mul_.Tensor: ("aten", "mul_")}
    try:
        got = {func: torch_compat.op_overload_name(func) for func in cases}
    except AttributeError as exc:
        pytest.fail(changed(f"torch._ops.OpOverload / OpOverloadPacket ({exc})"))
    assert got == cases, changed(f"torch._ops names: {got}")
    for not_an_op in (torch.add, torch.Tensor.add, torch.nn.functional.relu, len, "aten::add"):
        assert torch_compat.op_overload_name(not_an_op) is None, changed(f"what is a torch._ops type ({not_an_op})")

    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(torch_compat.op_overload_name(func))
            return func(*args, **(kwargs or {}))

    one = torch.ones(1)
    with Mode():
        torch.ops.aten.add(one, one)
        torch.ops.aten.add.Tensor(one, one)
    assert seen == [("aten", "add"), ("aten", "add")], changed(f"what a TorchFunctionMode sees of torch.ops: {seen}")


def test_tensor_base_class():
    try:
        base = torch_compat.tensor_base_class()
    except AttributeError as exc:
        pytest.fail(changed(f"torch._C.TensorBase ({exc})"))
    assert isinstance(base, type) and issubclass(torch.Tensor, base), changed("torch._C.TensorBase")
    for method in (torch.Tensor.add, torch.Tensor.matmul, torch.Tensor.mul_):
        assert getattr(method, "__objclass__", None) is base, changed(f"the owner of Tensor.{method.__name__}")


def test_dispatcher_op_names():
    try:
        names = torch_compat.dispatcher_op_names()
    except AttributeError as exc:
        pytest.fail(changed(f"torch._C._dispatch_get_all_op_names ({exc})"))
    assert {"aten::add.Tensor", "aten::matmul", "aten::native_layer_norm"} <= set(names), \
        changed("torch._C._dispatch_get_all_op_names() (aten operators missing)")
    bad = [n for n in names if n.startswith("aten::") and not n.split("::", 1)[1].split(".", 1)[0].isidentifier()]
    assert not bad, changed(f"the form of dispatcher operator names: {bad[:5]}")


def test_reentrant_checkpoint_function():
    try:
        fn_cls = torch_compat.reentrant_checkpoint_function()
        params = list(inspect.signature(fn_cls.forward).parameters)
    except (AttributeError, TypeError, ValueError) as exc:
        pytest.fail(changed(f"torch.utils.checkpoint.CheckpointFunction ({exc})"))
    assert params[:3] == ["ctx", "run_function", "preserve_rng_state"], \
        changed(f"CheckpointFunction.forward's signature: {params}")

    seen = []
    original = fn_cls.forward

    def forward(ctx, run_function, preserve_rng_state, *args):
        seen.append((run_function, preserve_rng_state))
        return original(ctx, run_function, preserve_rng_state, *args)

    def region(t):
        return (t * 2).sin()

    x = torch.ones(3, requires_grad=True)
    fn_cls.forward = staticmethod(forward)
    try:
        torch.utils.checkpoint.checkpoint(region, x, use_reentrant=True).sum().backward()
    finally:
        fn_cls.forward = original
    assert seen == [(region, True)], changed(f"what use_reentrant=True passes to CheckpointFunction.forward: {seen}")
    assert torch.allclose(x.grad, 2 * torch.cos(torch.full((3,), 2.0))), changed("reentrant checkpointing's gradient")


def test_tensor_version():
    """The agent relies on: an int; bumped by every in-place write (by name, `out=`, through a view, `x[i] = v`);
    unchanged by reads and out-of-place ops."""
    try:
        x = torch.zeros(4)
        v0 = torch_compat.tensor_version(x)
        assert isinstance(v0, int), changed("Tensor._version (not an int)")
        _ = x + 1
        _ = x.sum()
        assert torch_compat.tensor_version(x) == v0, changed("Tensor._version (bumped by a read)")
        x.add_(1)
        v1 = torch_compat.tensor_version(x)
        assert v1 > v0, changed("Tensor._version after add_")
        torch.mul(x, 2, out=x)
        v2 = torch_compat.tensor_version(x)
        assert v2 > v1, changed("Tensor._version after out=")
        x[1:3].zero_()
        v3 = torch_compat.tensor_version(x)
        assert v3 > v2, changed("Tensor._version of a base written through its view")
        x[0] = 5.0
        assert torch_compat.tensor_version(x) > v3, changed("Tensor._version after __setitem__")
    except AttributeError as exc:
        pytest.fail(changed(f"Tensor._version ({exc})"))


def test_generator_state_round_trip_is_shared_by_both_sides():
    """protos/rng.py: the agent records the state, the server sets it; the same draws follow."""
    from protos.rng import generator_state, set_generator_state

    state = generator_state("cpu")
    assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8
    first = torch.rand(5)
    set_generator_state(torch.device("cpu"), torch.frombuffer(bytearray(state.numpy().tobytes()), dtype=torch.uint8))
    assert torch.equal(torch.rand(5), first)
    assert generator_state("meta") is None   # a device type without a generator API


def test_written_arguments():
    """The agent relies on: the positions and names of the `Tensor(a!)` arguments of an overload and, as a union, of
    a packet; None for an operator that writes nothing and for anything that is not an operator."""
    try:
        assert torch_compat.written_arguments(torch.ops.aten.add_.Tensor) == ((0,), ("self",)), \
            changed("the schema of aten::add_.Tensor (written arguments)")
        assert torch_compat.written_arguments(torch.ops.aten.max.dim_max) == ((), ("max", "max_values")), \
            changed("the schema of aten::max.dim_max (keyword-only written arguments)")
        assert torch_compat.written_arguments(torch.ops.aten.add.out) == ((), ("out",)), \
            changed("the schema of aten::add.out")
        assert torch_compat.written_arguments(torch.ops.aten.add) == ((), ("out",)), \
            changed("the overloads of the packet aten::add")
        assert torch_compat.written_arguments(torch.ops.aten._foreach_add_.List) == ((0,), ("self",)), \
            changed("the schema of aten::_foreach_add_.List (a written list)")
        assert torch_compat.written_arguments(torch.ops.aten.mul.Tensor) is None, changed("aten::mul.Tensor")
        assert torch_compat.written_arguments(torch.add) is None
    except AttributeError as exc:
        pytest.fail(changed(f"OpOverload._schema / FunctionSchema.arguments / alias_info.is_write ({exc})"))


def test_find_operator():
    assert torch_compat.find_operator("aten", "add") is torch.ops.aten.add, changed("torch.ops.aten.add by name")
    assert torch_compat.find_operator("aten", "no_such_operator_here") is None
    assert torch_compat.find_operator("no_such_namespace_here", "add") is None
