"""A shape among a call's arguments (issue 25, goal 2): a tuple, list or torch.Size of plain values (layer_norm's
normalized_shape, view's and permute's sizes, a sum over dims) holds no tensor, so the capture's flat walks take it
as they take a scalar: the inputs' snapshot keeps a tuple of scalars as it is (a tuple cannot change), and the
backward taps pass over it. Before, such a call took the general tree walks (layer_norm's taps 17 us more). The
records must be exactly those of the tree walks, byte for byte; so must those of a call with a tensor as a keyword
argument (layer_norm's weight and bias), which the flat taps now take too. A container that may hold a tensor, and a
list the training may change later, still take the tree walks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npu_agent import backward, snapshot
from npu_agent.records import encode_record
from tests.support import capture


def _calls(x, w, b):
    y = F.layer_norm(x, (8,), w, b)                      # a tuple
    y = y.view([2, 3, 8]).permute((0, 2, 1))             # a list, a tuple
    y = y.reshape(y.shape) * 2                            # a torch.Size
    y = torch.sum(y, dim=(1,), keepdim=True)              # a tuple as a keyword
    y = torch.add(y, other=y * 3, alpha=0.5)              # a tensor as a keyword
    y = y + torch.cat([x.view(2, 3, 8)[:, :1], x.view(2, 3, 8)[:, 1:2]], dim=1).sum(dim=2, keepdim=True)   # tensors
    return y.sum()


def _records() -> list[tuple]:
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    out = []
    with capture() as (mode, sink):
        with mode:
            loss = _calls(x * 1, w, b)
            loss.backward()
        mode.capturer.backward.end_step()
        for rec in sink:
            rec.seq = len(out)
            enc = encode_record(rec, "run", 0)
            out.append((rec.name, rec.direction, enc.record.SerializeToString(),
                        b"".join(bytes(f) for f in enc.wire_frames(1 << 30))))
    return out


def test_calls_with_shapes_give_the_records_of_the_tree_walks(monkeypatch):
    walks: list[str] = []
    real_tree, real_flat = backward.BackwardTaps._tap_tree, backward.BackwardTaps._tap_flat

    def tree(self, ctx, rec):
        walks.append(ctx.api)
        return real_tree(self, ctx, rec)

    with monkeypatch.context() as m:
        m.setattr(backward.BackwardTaps, "_tap_tree", tree)
        fast = _records()
    assert sorted(set(walks)) == ["__getitem__", "cat"], walks   # a slice, a list of tensors: the tree walk
    with monkeypatch.context() as m:   # every call with a shape or a tensor keyword through the general walks
        m.setattr(backward, "without_tensors", lambda seq: False)
        m.setattr(snapshot, "without_tensors", lambda seq: False)
        m.setattr(backward.BackwardTaps, "_tap_flat", lambda self, ctx, rec, args, kwargs: not kwargs and
                  real_flat(self, ctx, rec, args, kwargs))
        slow = _records()
    names = [r[0] for r in fast]
    for api in ("layer_norm", "view", "permute", "reshape", "sum", "add", "cat"):
        assert sum(f".{api}." in n for n in names) >= 1, (api, names)
    assert sum(r[1] == 2 for r in fast) >= 6   # the backward records are there ...
    assert fast == slow                         # ... byte for byte, in the same order


def _same(a, b) -> bool:
    """The same tree: equal containers of the same types, the same tensor objects, equal other leaves."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("arg,flat", [((8,), True), ((), True), ([2, 4], False), (torch.Size([2, 4]), False),
                                      ((2, torch.ones(1, requires_grad=True)), False), (((1, 2),), False)])
def test_the_inputs_snapshot_keeps_only_a_tuple_of_scalars_as_it_is(monkeypatch, arg, flat):
    """The flat walk holds what `snapshot` holds (the same tree, tensors, bytes, requires_grad), keeping a plain tuple
    of scalars itself; anything else still goes to `snapshot`."""
    x = torch.randn(2, 4, requires_grad=True)
    general: list[object] = []
    real = snapshot.snapshot
    monkeypatch.setattr(snapshot, "snapshot", lambda obj, copy=False: general.append(obj) or real(obj, copy))
    snap = snapshot.snapshot_call((x, arg), {"dims": arg})
    ref = real(((x, arg), {"dims": arg}))
    assert (not general) is flat
    assert _same(snap.tree, ref.tree), (snap.tree, ref.tree)
    assert snap.held.keys() == ref.held.keys() and snap.nbytes == ref.nbytes
    assert snap.requires_grad == ref.requires_grad
    if flat:
        assert snap.tree[0][1] is arg and snap.tree[1]["dims"] is arg
    for one in (snap, ref):
        snapshot.HELD.pending.pop(id(one), None)


def test_a_list_the_training_changes_after_the_call_keeps_its_value_in_the_record():
    dims = [1, 0]
    x = torch.randn(2, 3)
    with capture() as (mode, sink):
        with mode:
            x.permute(dims)
        dims[0] = 0
    assert sink.forward("Tensor.permute.0").inputs.tree[0][1] == [1, 0]
