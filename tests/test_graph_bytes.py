"""What a kept forward graph holds (gpu_server/replay/run.py `held_bytes`, counted against --graph-memory-mb), against
torch's own view of it: every tensor autograd saves for the backward (but a wrapped number) goes through the
saved-tensor hooks, so a forward run under a hook that notes each one's memory gives the same total independently of
the graph walk. A linear holds
its leaves and its output; an attention, a dropout or a Python autograd function holds more than that, and shared
memory (views, a saved leaf) counts once."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_server.replay.run import held_bytes, run_forward_kept
from tests.support import capture, to_job

CPU = torch.device("cpu")


def _hooked(fn, *args, **kwargs):
    """fn(*args, **kwargs) run with autograd saving through a hook that notes each saved tensor's memory: (its
    result, the saved tensors' storages by address, with their sizes)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(*args, **kwargs), saved


def _union(saved: dict[int, int], *tensors: torch.Tensor) -> int:
    every = dict(saved)
    for t in tensors:
        every[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(every.values())


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001
        mid = x * 2
        ctx.save_for_backward(mid)   # a tensor of its own, neither input nor output
        return mid + 1

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        (mid,) = ctx.saved_tensors
        return g * 2 + 0 * mid


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, 32, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(24, 32, dtype=torch.float64, generator=g).requires_grad_()
    mha = torch.nn.MultiheadAttention(32, 4, dtype=torch.float64, batch_first=True)
    params = [p.detach().requires_grad_() for p in (mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight,
                                                    mha.out_proj.bias)]
    yield "linear", [x, w], lambda: F.linear(x, w)
    yield "layer_norm", [x], lambda: F.layer_norm(x, (32,))
    yield "dropout", [x], lambda: F.dropout(x, 0.3, training=True)
    yield "view", [x], lambda: x.transpose(0, 1)
    yield "python function", [x], lambda: _Twice.apply(x)
    yield "attention", [x, *params], lambda: F.multi_head_attention_forward(
        x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), 32, 4, params[0], params[1], None, None, False,
        0.0, params[2], params[3], training=True, need_weights=True)


def test_the_graph_walk_finds_what_autograd_saved():
    for name, leaves, fn in _cases():
        out, saved = _hooked(fn)
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
        want = _union(saved, *leaves, *outs)
        # autograd saves a wrapped number (a Python scalar made a 0-dim tensor: attention's scaling) without the
        # hooks; the walk finds it too, a few bytes more
        assert want <= held_bytes(leaves, outs) <= want + 16, name


def test_a_linear_holds_its_inputs_and_output_once_an_attention_more():
    x = torch.randn(64, 128, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, 128, dtype=torch.float64, requires_grad=True)
    y = F.linear(x, w)
    assert held_bytes([x, w], [y]) == x.nbytes + w.nbytes + y.nbytes   # it saves x and w: nothing new
    v = x.t()
    assert held_bytes([x], [v]) == x.nbytes                             # a view is the leaf's memory
    s = torch.softmax(x, -1)
    assert held_bytes([x], [s]) == x.nbytes + s.nbytes                  # softmax saves its output
    e = torch.exp(x).sin()
    assert held_bytes([x], [e]) == x.nbytes + 2 * e.nbytes   # exp saves its result, sin its input: one memory


def test_a_replayed_forward_counts_what_its_graph_holds():
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            y = lin(mha(x, x, x)[0])
        y.sum().backward()
    for name in ("Functional.multi_head_attention_forward.0", "Functional.linear.0"):
        job = to_job(sink.forward(name))
        for bench in (True, False):
            (out, kept), saved = _hooked(run_forward_kept, job, CPU, bench=bench)
            assert kept is not None, name
            outs = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
            want = _union(saved, *kept.leaves.values(), *outs)
            assert want <= kept.nbytes <= want + 16, (name, bench)
