"""Autograd hooks put on in C++ (npu_agent/_fasthook.cpp, issue 25 goal 2): `post_hook(node, fn, *args)` and
`pre_hook(node, fn, *args)` call `fn(*args, ...)` exactly when, and with exactly what, torch's
`node.register_hook(functools.partial(fn, *args))` and `node.register_prehook(...)` do (the same tuples of
gradients, None where one is undefined, in the same order among the node's other hooks), let an exception out of
the backward the same way, hand the hook to compiled autograd as torch does, take torch's registration for a node
that is not a C++ node, and let go of `fn` and its arguments with the node; the backward taps use them where built,
and the Python registration otherwise (a training gives the same records either way: tests/test_fasttap.py)."""
from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from npu_agent import backward as B
from npu_agent.compiled import HOOK, PURE_PYTHON_ENV
from tests.support import built


@pytest.fixture(scope="module")
def hooks():
    """The compiled module, built here if the set-up did not build it."""
    return built(HOOK)


def _what(grads) -> tuple:
    """The container's type (a tuple; compiled autograd gives lists), each gradient as None or (shape, dtype, the sum
    of its values)."""
    return (type(grads).__name__,
            [None if g is None else (tuple(g.shape), g.dtype, g.double().sum().item()) for g in grads])


def _record(into: list, tag: str, grad_inputs, grad_outputs) -> None:
    """A post-hook with its list and tag bound: (tag, what of grad_inputs, what of grad_outputs) into the list."""
    into.append((tag, _what(grad_inputs), _what(grad_outputs)))


def _record_pre(into: list, tag: str, grad_outputs) -> None:
    into.append((tag, _what(grad_outputs)))


def _seen(into: list, tag: str):
    return functools.partial(_record, into, tag)


def _seen_pre(into: list, tag: str):
    return functools.partial(_record_pre, into, tag)


def _graphs():
    """(name, a function making a fresh graph: (the nodes to hook, the loss)), over nodes of every shape a training
    meets: a product of two leaves, a node with several outputs, one whose inputs include a tensor without grad and an
    integer one (None in its grad_inputs), a composite's inner node, an in-place op."""
    def mm():
        a = torch.randn(3, 4, requires_grad=True)
        b = torch.randn(4, 5, requires_grad=True)
        y = (a @ b).sin()
        return [y.grad_fn, y.grad_fn.next_functions[0][0]], y.sum()

    def split():
        x = torch.randn(6, 4, requires_grad=True) * 2
        a, b, c = torch.split(x, 2)
        return [a.grad_fn, x.grad_fn], (a * 3 + c).sum()   # b gets no gradient: an undefined grad_output

    def layer_norm():
        x = torch.randn(2, 8, requires_grad=True)
        w = torch.randn(8)   # no grad: None among the node's grad_inputs
        y = F.layer_norm(x, (8,), w, torch.randn(8, requires_grad=True))
        return [y.grad_fn], (y * y).sum()

    def embedding():
        w = torch.randn(10, 3, requires_grad=True)
        y = F.embedding(torch.tensor([[1, 2], [2, 9]]), w)
        return [y.grad_fn], y.pow(2).sum()

    def inplace():
        x = torch.randn(5, requires_grad=True) + 0
        x.mul_(3)
        return [x.grad_fn], x.exp().sum()

    return [("mm", mm), ("split", split), ("layer_norm", layer_norm), ("embedding", embedding), ("inplace", inplace)]


@pytest.mark.parametrize("name,make", _graphs(), ids=[n for n, _ in _graphs()])
def test_the_hooks_get_what_torchs_registration_gives(hooks, name, make):
    results = []
    for compiled in (True, False):
        got: list = []
        torch.manual_seed(7)
        nodes, loss = make()
        for i, node in enumerate(nodes):
            if compiled:   # the list and the tag bound by post_hook itself
                hooks.post_hook(node, _record, got, f"post{i}")
                hooks.pre_hook(node, _record_pre, got, f"pre{i}")
            else:
                node.register_hook(_seen(got, f"post{i}"))
                node.register_prehook(_seen_pre(got, f"pre{i}"))
        loss.backward()
        results.append(got)
    assert results[0] == results[1]
    assert len(results[0]) == 2 * len(make()[0]), results[0]   # every hook ran once
    assert all(r[1][0] == "tuple" for r in results[0])


def _order(hooks, compiled: bool) -> list[str]:
    """The order in which one node's hooks run: a user's put on before ours, ours, a user's put on after."""
    order: list[str] = []
    a = torch.randn(3, requires_grad=True)
    y = a.exp()
    y.grad_fn.register_hook(lambda gi, go: order.append("user before"))
    y.grad_fn.register_prehook(lambda go: order.append("user pre before"))
    if compiled:   # into torch's dict of the node's Python hooks, with its arguments bound
        hooks.post_hook(y.grad_fn, lambda what, gi, go: order.append(what), "ours")
        hooks.pre_hook(y.grad_fn, lambda what, go: order.append(what), "ours pre")
    else:
        y.grad_fn.register_hook(lambda gi, go: order.append("ours"))
        y.grad_fn.register_prehook(lambda go: order.append("ours pre"))
    y.grad_fn.register_hook(lambda gi, go: order.append("user after"))
    y.grad_fn.register_prehook(lambda go: order.append("user pre after"))
    y.sum().backward()
    return order


def test_the_order_among_the_nodes_other_python_hooks(hooks):
    """A user's hook put on before ours runs before it, one put on after runs after it, as with torch's own
    registration (where all of them share one dict)."""
    assert _order(hooks, True) == _order(hooks, False) == ["user pre before", "ours pre", "user pre after",
                                                           "user before", "ours", "user after"]


def test_an_exception_leaves_the_backward_as_it_would(hooks):
    def boom(*grads):
        raise KeyError("from the hook")

    for put in (hooks.post_hook, hooks.pre_hook):
        y = torch.randn(4, requires_grad=True).sin()
        put(y.grad_fn, boom)
        with pytest.raises(KeyError, match="from the hook"):
            y.sum().backward()


def test_what_the_hook_returns_is_ignored(hooks):
    """The backward taps' hooks return None; a returned tensor does not replace a gradient (torch's Python hooks
    would take it: documented in the module)."""
    a = torch.randn(3, requires_grad=True)
    y = a * 2
    hooks.post_hook(y.grad_fn, lambda gi, go: (torch.full_like(gi[0], 100.0),))
    hooks.pre_hook(y.grad_fn, lambda go: (torch.full_like(go[0], 100.0),))
    y.sum().backward()
    assert torch.equal(a.grad, torch.full((3,), 2.0))


def test_a_custom_functions_node_takes_torchs_registration(hooks):
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    got: list = []
    a = torch.randn(3, requires_grad=True)
    y = Twice.apply(a)
    hooks.post_hook(y.grad_fn, _record, got, "post")
    hooks.pre_hook(y.grad_fn, _record_pre, got, "pre")
    y.sum().backward()
    assert [g[0] for g in got] == ["pre", "post"]
    assert got[1][1] == ("tuple", [((3,), torch.float32, pytest.approx(6.0))])


def test_bad_arguments_say_what_is_expected(hooks):
    y = torch.randn(2, requires_grad=True).exp()
    with pytest.raises(TypeError, match=r"post_hook\(node, fn, \*args\)"):
        hooks.post_hook(y.grad_fn, "not callable")
    with pytest.raises(TypeError, match=r"pre_hook\(node, fn, \*args\)"):
        hooks.pre_hook(y.grad_fn)
    with pytest.raises(AttributeError):   # not a node at all: torch's registration is asked, and it has none
        hooks.post_hook(object(), lambda gi, go: None)


def test_the_hook_is_let_go_with_its_node(hooks):
    class Hook:
        def __call__(self, *grads):
            pass

    for put in (hooks.post_hook, hooks.pre_hook):
        fn, arg = Hook(), Hook()
        refs = weakref.ref(fn), weakref.ref(arg)
        y = torch.randn(3, requires_grad=True).exp()
        put(y.grad_fn, fn, arg)
        del fn, arg
        gc.collect()
        assert all(r() is not None for r in refs)   # held by the node
        del y
        gc.collect()
        assert all(r() is None for r in refs)


@pytest.mark.parametrize("count", [0, 1, 6, 7, 9])
def test_any_number_of_bound_arguments(hooks, count):
    """Up to six arguments go on the call's stack, more through a tuple: the same call either way."""
    bound = tuple(f"a{i}" for i in range(count))
    got: list = []
    y = torch.randn(2, requires_grad=True).exp()
    hooks.post_hook(y.grad_fn, lambda *a: got.append(("post", a[:-2], _what(a[-2]), _what(a[-1]))), *bound)
    hooks.pre_hook(y.grad_fn, lambda *a: got.append(("pre", a[:-1], _what(a[-1]))), *bound)
    y.sum().backward()
    assert [g[:2] for g in got] == [("pre", bound), ("post", bound)]
    assert got[1][2][1][0][0] == (2,) and got[1][3][1] == [((2,), torch.float32, 2.0)]


def test_compiled_autograd_calls_the_hooks_as_torchs(hooks):
    import torch._dynamo.compiled_autograd as ca

    results = []
    for compiled in (True, False):
        got: list = []
        torch.manual_seed(3)
        a = torch.randn(4, 4, requires_grad=True)
        b = torch.randn(4, 4, requires_grad=True)
        y = (a @ b).sin()
        inner = y.grad_fn.next_functions[0][0]
        if compiled:
            hooks.post_hook(inner, _record, got, "post")
            hooks.pre_hook(y.grad_fn, _record_pre, got, "pre")
        else:
            inner.register_hook(_seen(got, "post"))
            y.grad_fn.register_prehook(_seen_pre(got, "pre"))
        with ca._enable(torch.compile(backend="eager")):
            y.sum().backward()
        results.append((got, a.grad.clone()))
    assert results[0][0] == results[1][0] and [g[0] for g in results[0][0]] == ["pre", "post"]
    assert torch.equal(results[0][1], results[1][1])


def test_the_taps_use_them_where_built_and_python_otherwise(monkeypatch, tmp_path, hooks):
    monkeypatch.setattr(B, "_post_hook", None)   # (restored after the test)
    monkeypatch.setattr(B, "_pre_hook", None)
    monkeypatch.setattr(B, "_copy", None)
    monkeypatch.setattr(HOOK, "loaded", [])
    B.use_compiled()
    assert (B._post_hook, B._pre_hook, B._copy) == (hooks.post_hook, hooks.pre_hook, hooks.copy_grad)
    monkeypatch.setattr(HOOK, "loaded", [])
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    B.use_compiled()
    assert (B._post_hook, B._pre_hook, B._copy) == (B._post_hook_py, B._pre_hook_py, B._copy_py)
    monkeypatch.setattr(HOOK, "loaded", [])
    monkeypatch.delenv(PURE_PYTHON_ENV)
    monkeypatch.setattr(HOOK, "source", tmp_path / "_fasthook.cpp")   # a changed source: its binary is not built
    (tmp_path / "_fasthook.cpp").write_text("// another source\n")
    B.use_compiled()
    assert (B._post_hook, B._pre_hook, B._copy) == (B._post_hook_py, B._pre_hook_py, B._copy_py)


def test_another_torch_finds_the_binary_missing(monkeypatch, hooks):
    """The binary's name carries the torch it was built for: another version (or commit, or ABI) never loads it."""
    built = HOOK.binary_path()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert HOOK.binary_path() != built


class Tagged(torch.Tensor):
    """A subclass with its own __torch_function__ (the copy is made with torch's Python functions out of the way)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def _grads() -> dict:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    return {
        "dense": x,
        "bfloat16": x.bfloat16(),
        "transposed": x.t(),
        "channels last": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "a view": x[1:, ::2],
        "requires grad": x.clone().requires_grad_(),
        "a subclass": x.clone().as_subclass(Tagged),
        "empty": torch.empty(0, 3),
    }


@pytest.mark.parametrize("name", list(_grads()), ids=list(_grads()))
def test_a_gradient_copied_as_the_python_path_copies_it(hooks, name):
    g = _grads()[name]
    ours, theirs = hooks.copy_grad(g), B._copy_py(g)
    for c in (ours, theirs):
        assert c is not g and (c.numel() == 0 or c.untyped_storage().data_ptr() != g.untyped_storage().data_ptr())
    assert type(ours) is type(theirs) and not ours.requires_grad
    assert (ours.dtype, ours.shape, ours.stride()) == (theirs.dtype, theirs.shape, theirs.stride())
    assert torch.equal(ours, theirs) and torch.equal(ours, g.detach())


def test_copy_grad_of_none_and_of_what_is_no_tensor(hooks):
    assert hooks.copy_grad(None) is None
    with pytest.raises(TypeError, match="copy_grad"):
        hooks.copy_grad([1.0])
