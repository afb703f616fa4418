"""A captured call's flat arguments read in C (npu_agent/_fasttap.c, issue 25 goal 2): `scan` appends exactly what
the Python path (backward._scan_py) appends to the call's signature and returns the same tensors to tap, and `hold`
holds exactly the tensors snapshot._hold_flat holds, or None where they do, for every kind of argument; `hooks_of`
finds the same hooks as backward._hooks_of_py for every known tree of a training, and None for the same altered
ones; a training captured with them makes the same records, forward and backward, as one captured with the Python
paths; and the Python paths run where the module is not built or not wanted."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from npu_agent import PrecisionDebugger
from npu_agent import backward as B
from npu_agent import capture as C
from npu_agent import snapshot as S
from npu_agent.compiled import HOOK, MASK, PURE_PYTHON_ENV, TAP
from npu_agent.snapshot import KIND_OF, iter_tensors
from tests.support import ListSink, agent_config, built


@pytest.fixture(scope="module")
def scan():
    """The compiled `scan`, built here if the set-up did not build it (scripts/setup.sh does), and the hooks put on
    in C++ (npu_agent/_fasthook.cpp, tests/test_fasthook.py) and the random calls' pieces (npu_agent/_fastmask.cpp,
    tests/test_fastmask.py), which a training uses beside it."""
    built(TAP)
    built(HOOK)
    built(MASK)
    B.use_compiled()
    assert B._scan is not B._scan_py and B._hooks_of is not B._hooks_of_py, "npu_agent/_fasttap.c did not load"
    assert B._post_hook is not B._post_hook_py, "npu_agent/_fasthook.cpp did not load"
    return B._scan


@pytest.fixture(scope="module")
def hold(scan):
    S.use_compiled()
    assert S._read_flat is not S._hold_flat, "npu_agent/_fasttap.c did not load"
    return S._read_flat


class Odd:
    """A type the argument tables have not met: its kind is computed (and remembered) on the way."""


class BadDim(torch.Tensor):
    """A tensor whose dim() raises: the read fails as the Python path's does."""

    def dim(self) -> int:
        raise ValueError("no dimensions here")


_X = torch.randn(3, 4, requires_grad=True)
_Y = torch.randn(2)
_C = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
_I = torch.ones(3, dtype=torch.long)
_P = torch.nn.Parameter(torch.randn(2))

CASES = {
    "tensors": ((_X, _Y), {}),
    "scalars": ((_X, 1.5, 0.0, -0.0, math.nan, math.inf, 3, 0, True, False, None, "mean"), {"dim": 1, "eps": 1e-5}),
    "a shape as a list": ((_X, [1, 2]), {}),
    "a shape as a tuple": ((_X, (2, 3)), {}),
    "torch types": ((_X, torch.Size([3, 4]), torch.float32, torch.device("cpu"), torch.strided,
                     torch.channels_last), {}),
    "complex, integer and a parameter": ((_C, _I, _P), {"alpha": 2.0, "out": None}),
    "a tensor by keyword": ((_X,), {"weight": _P, "bias": _Y}),
    "a list holding a tensor": ((_X, [_Y]), {}),
    "a keyword list holding a tensor": ((_X,), {"tensors": [_X, _Y]}),
    "a slice": ((_X, slice(0, 2)), {}),
    "a dict": ((_X, {"a": 1}), {}),
    "a float subclass": ((_X, np.float64(0.0), np.float32(2.0)), {}),
    "a type met now": ((_X, Odd()), {"other": Odd()}),
    "no arguments": ((), {}),
    "no tensor": ((1, 2.0), {"k": "v"}),
    "a tensor not requiring grad first": ((_X.detach(), _X), {}),
    "a tensor twice": ((_X, _Y, _X), {"again": _Y}),
    "a shape as torch.Size": ((_X, torch.Size([3, 4])), {}),
    "a keyword shape": ((_X,), {"size": (3, 4)}),
    "a tuple holding a tensor": ((_X, (_Y, 1)), {}),
}


def _same(a: list, b: list) -> bool:
    """Equal and of the same types, element by element (True == 1 in Python; NaN != NaN)."""
    def key(v):
        if isinstance(v, tuple):
            return tuple(key(e) for e in v)
        if isinstance(v, float) and math.isnan(v):
            return (float, "nan")
        return (type(v), v if not isinstance(v, torch.Tensor) else id(v))
    return [key(v) for v in a] == [key(v) for v in b]


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_signature_and_taps_as_the_python_path(scan, case):
    args, kwargs = CASES[case]
    head = ["Functional", "api", (False, "float32", "cpu"), len(args)]
    py_sig, c_sig = list(head), list(head)
    py = B._scan_py(args, kwargs, py_sig)
    c = scan(args, kwargs, c_sig)
    assert (py is None) == (c is None), (py, c)
    assert _same(py_sig, c_sig), (py_sig, c_sig)   # (None: the read ended at the same argument)
    if py is not None:
        assert [(k, id(t), pos) for k, t, pos in py] == [(k, id(t), pos) for k, t, pos in c]


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_tensors_held_as_the_python_path(hold, case):
    args, kwargs = CASES[case]
    py_held, py_grads, c_held, c_grads = {}, set(), {}, set()
    py = S._hold_flat(args, kwargs, py_held, py_grads)
    c = hold(args, kwargs, c_held, c_grads)
    assert py == c and type(py) is type(c), (py, c)
    assert list(py_held) == list(c_held) and py_grads == c_grads   # the same ids, in the same order
    for tid, entry in py_held.items():
        other = c_held[tid]
        assert len(other) == 4 and other[0] is entry[0] and other[1] == entry[1] and other[2:] == [None, None]


def test_what_is_held(hold):
    x = torch.randn(3, requires_grad=True)   # version 0
    y = torch.ones(2, 2, dtype=torch.float16)
    y.mul_(2)   # version 1
    for read in (S._hold_flat, hold):
        held, grads = {}, set()
        assert read((x, 2.0, (1, 2)), {"other": y, "again": x}, held, grads) == 3 * 4 + 4 * 2
        assert {k: (e[0] is v, e[1]) for (k, e), v in zip(held.items(), (x, y))} == {id(x): (True, 0),
                                                                                   id(y): (True, 1)}
        assert grads == {id(x)}


_G = torch.randn(4, 3)
_GRADS = {
    "one": [_G],
    "none arrived": [None, None],
    "some": [None, _G, torch.ones(2, dtype=torch.bfloat16)],
    "the same twice": [_G, None, _G],
    "requiring grad (create_graph)": [torch.randn(2, requires_grad=True)],
    "empty": [],
    "a subclass": [torch.nn.Parameter(torch.randn(5))],
}


@pytest.mark.parametrize("case", list(_GRADS), ids=list(_GRADS))
def test_a_backward_records_gradients_held_as_the_python_path_holds_them(hold, case):
    """snapshot.take_grads in C (`grads`): the same tree, bytes, held entries and no ids requiring grad, registered
    with HELD as the Python path registers them."""
    values = list(_GRADS[case])
    got = []
    for take in (S.grads_snapshot, S.take_grads):
        snap = take(values)
        assert type(snap) is S.Snapshot
        assert snap.tree == values and snap.tree is not values
        ref = S.HELD.pending.get(id(snap))   # (an id may stand for a snapshot gone, its reference dead)
        assert (ref is not None and ref() is snap) == bool(snap.held)
        tensors = {id(t): t for t in values if t is not None}
        assert list(snap.held) == list(tensors)   # each tensor once, in order
        got.append((snap.nbytes, snap.requires_grad,
                    [(e[0] is tensors[k], e[1], e[2:]) for k, e in snap.held.items()]))
    assert S.take_grads is not S.grads_snapshot
    assert got[0] == got[1]
    assert got[1][1] == set()


def test_grads_says_what_it_takes(hold):
    with pytest.raises(TypeError, match="grads"):
        S.take_grads((_G,))
    with pytest.raises(AttributeError):   # not a tensor: as the Python path, which reads its _version
        S.take_grads([object()])


def test_what_each_argument_gives(scan):
    """The signature's parts, spelled out for one call (the Python path is checked against this too)."""
    args, kwargs = (_X, 0.0, 2.5, 3, torch.float16, _Y), {"p": _P, "flag": True}
    for read in (B._scan_py, scan):
        sig: list = []
        tapped = read(args, kwargs, sig)
        assert _same(sig, [(0, True, torch.float32, 2), True, False, 3, torch.float16, (5, False, torch.float32, 1),
                           ("p", True, torch.float32, 1), True])
        assert [(k, t is v, pos) for (k, t, pos), v in zip(tapped, (_X, _P))] == [(0, True, 0), ("p", True, 2)]


def test_a_type_met_first_is_remembered_by_both(scan):
    class Fresh:
        pass

    for read in (scan, B._scan_py):
        KIND_OF.pop(Fresh, None)
        sig: list = []
        assert read((Fresh(),), {}, sig) == [] and sig == [Fresh]
        assert KIND_OF[Fresh] == 0


def test_the_c_reads_look_their_names_up_as_python_does(monkeypatch, scan, hold):
    """Each C read takes KIND_OF, arg_kind, without_tensors (and VALUE_KEYS) from its Python twin's module at each
    call, as Python looks up its globals: a name replaced there (a test's monkeypatch) is replaced for both."""
    assert scan((_X, [1, 2]), {}, []) is not None and hold((_X, (8,)), {}, {}, set()) is not None
    monkeypatch.setattr(B, "without_tensors", lambda seq: False)
    monkeypatch.setattr(S, "without_tensors", lambda seq: False)
    for read in (B._scan_py, scan):
        assert read((_X, [1, 2]), {}, []) is None
    for read in (S._hold_flat, hold):
        assert read((_X, (8,)), {}, {}, set()) is None
    monkeypatch.setattr(B, "VALUE_KEYS", frozenset())
    for read in (B._scan_py, scan):
        sig: list = []
        read((_X, 3), {}, sig)
        assert sig[1] is int


def test_an_argument_that_fails_fails_the_same(scan):
    bad = torch.randn(2, requires_grad=True).as_subclass(BadDim)
    for read in (B._scan_py, scan):
        with pytest.raises(ValueError, match="no dimensions here"):
            read((bad,), {}, [])


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(idx))
        h = F.dropout(F.gelu(self.fc(h)), p=0.1, training=True)
        a, b = torch.split(h, 8, dim=-1)                     # several outputs: aliases
        h = torch.cat([b, a], dim=-1) * 0.5                  # a list argument: the tree walk
        return F.cross_entropy(h.reshape(-1, 16), idx.reshape(-1) % 16, reduction="mean")


def _train(tmp_path, monkeypatch, tag: str, compiled: bool, steps: int = 4, hooks_of=None) -> list:
    folder = tmp_path / f"{tag}-folder"
    folder.mkdir()
    cfg = agent_config(os.path.join(str(tmp_path), f"{tag}.json"), nfs_path=str(folder), online_close_timeout_s=1)
    dbg = PrecisionDebugger(config_path=cfg)
    assert dbg._ensure_started() and dbg._capturer is not None and dbg._capturer.backward is not None
    cap = dbg._capturer
    sink = ListSink()
    cap.sink = cap.backward.sink = sink.append
    if not compiled:
        monkeypatch.setattr(B, "_scan", B._scan_py)
        monkeypatch.setattr(B, "_hooks_of", B._hooks_of_py)
        monkeypatch.setattr(S, "_read_flat", S._hold_flat)
        monkeypatch.setattr(B, "_post_hook", B._post_hook_py)
        monkeypatch.setattr(B, "_pre_hook", B._pre_hook_py)
        monkeypatch.setattr(B, "_copy", B._copy_py)
        monkeypatch.setattr(S, "take_grads", S.grads_snapshot)
        monkeypatch.setattr(C, "_finite_nonzero", C._finite_nonzero_py)
        monkeypatch.setattr(C, "_state_bytes", C._state_bytes_py)
    python = (B._scan is B._scan_py, B._hooks_of is B._hooks_of_py, S._read_flat is S._hold_flat,
              B._post_hook is B._post_hook_py, B._pre_hook is B._pre_hook_py, B._copy is B._copy_py,
              S.take_grads is S.grads_snapshot, C._finite_nonzero is C._finite_nonzero_py,
              C._state_bytes is C._state_bytes_py)
    assert python == (not compiled,) * 9, python
    if hooks_of is not None:
        monkeypatch.setattr(B, "_hooks_of", hooks_of)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(steps):
            dbg.start()
            model(torch.randint(0, 20, (2, 5))).backward()
            dbg.stop()
            opt.step()
            opt.zero_grad()
            dbg.step()
        known = len(cap.backward.known)
    finally:
        dbg.close()
    records = []
    for r in sink:
        tensors = [t for snap in (r.inputs, r.output, r.grad_input, r.grad_output) if snap is not None
                   for t in iter_tensors(snap.tree)]
        records.append((r.step, r.name, r.direction, r.backward_expected, r.module, r.skip_reason, r.rng_state,
                        None if r.mask is None else r.mask.tolist(),
                        [(t.shape, t.dtype, t.double().sum().item()) for t in tensors],
                        sorted(len(s.held) for s in (r.inputs, r.output) if s is not None)))
    return [records, known]


def test_a_training_makes_the_same_records_either_way(tmp_path, monkeypatch, scan):
    fast = _train(tmp_path, monkeypatch, "fast", True)
    slow = _train(tmp_path, monkeypatch, "slow", False)
    assert fast[0] == slow[0]   # names, directions, modules, every input, output and gradient of every record
    assert fast[1] == slow[1] > 0   # the same calls learned as known trees (the signatures are the same)
    assert any(r[2] == 2 and r[8] for r in fast[0]), "no backward record with gradients: the test proves nothing"
    assert any(r[6] and r[7] is not None for r in fast[0]), "no dropout record with its state and mask"


def test_the_python_path_when_asked_or_not_built(monkeypatch, tmp_path, scan):
    for module, name in ((B, "_scan"), (B, "_hooks_of"), (S, "_read_flat"), (S, "take_grads")):
        monkeypatch.setattr(module, name, None)   # (restored after the test)
    monkeypatch.setattr(TAP, "loaded", [])
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    B.use_compiled()
    S.use_compiled()
    assert (B._scan, B._hooks_of, S._read_flat, S.take_grads) == (B._scan_py, B._hooks_of_py, S._hold_flat,
                                                                   S.grads_snapshot)
    monkeypatch.setattr(TAP, "loaded", [])
    monkeypatch.delenv(PURE_PYTHON_ENV)
    monkeypatch.setattr(TAP, "source", tmp_path / "_fasttap.c")   # a changed source: its binary is not built
    (tmp_path / "_fasttap.c").write_text("/* another source */\n")
    B.use_compiled()
    S.use_compiled()
    assert (B._scan, B._hooks_of, S._read_flat, S.take_grads) == (B._scan_py, B._hooks_of_py, S._hold_flat,
                                                                   S.grads_snapshot)


def test_every_known_tree_of_a_training_gets_the_same_hooks_both_ways(tmp_path, monkeypatch, scan):
    """Each known tree checked in a training (linear on 3-D inputs: a composite's small tree; views, dropout,
    layer norm, embedding: one node), by both checks, and each again altered: a node's edge count, its edges that are
    not None, an edge to another slot, a leaf taken for another tensor; the same hooks, or None, either way."""
    compiled = B._hooks_of
    seen = {"calls": 0, "found": 0, "altered": 0}

    def both(tree, fn, inputs, leaf):
        py, c = B._hooks_of_py(tree, fn, inputs, leaf), compiled(tree, fn, inputs, leaf)
        assert _hooks(py) == _hooks(c), (tree, py, c)
        seen["calls"] += 1
        seen["found"] += py is not None
        for altered in _altered(tree):
            a, b = B._hooks_of_py(altered, fn, inputs, leaf), compiled(altered, fn, inputs, leaf)
            assert _hooks(a) == _hooks(b), (altered, a, b)
            seen["altered"] += 1
        return c

    records = _train(tmp_path, monkeypatch, "both", True, steps=3, hooks_of=both)[0]
    assert records and seen["found"] >= 10 and seen["altered"] > 50, seen


def _hooks(found):
    return None if found is None else [(id(node), edges) for node, edges in found]


def _altered(tree):
    """Trees like `tree`, each wrong in one way (an edge to another of its slots where it has several)."""
    slots = sorted({slot for *_, edges in tree for _, slot in edges})
    out = []
    for k, (parent, j, size, count, edges) in enumerate(tree):
        def one(entry, k=k):
            return tree[:k] + (entry,) + tree[k + 1:]
        out.append(one((parent, j, size + 1, count, edges)))
        out.append(one((parent, j, size, count - 1, edges)))
        if edges:
            (i, slot), rest = edges[0], edges[1:]
            if len(slots) > 1:
                other = slots[(slots.index(slot) + 1) % len(slots)]
                out.append(one((parent, j, size, count, ((i, other),) + rest)))
            out.append(one((parent, j, size, count, ((size - 1 - i, slot),) + rest)))
    return out


def _learned(call, *tensors):
    """The tree `call` makes over `tensors` (aliases, as a first call has them), and the output's node of the same
    call made without aliases."""
    aliases = [t.view_as(t) for t in tensors]
    tree = B._tree_of(call(*aliases).grad_fn, [(a.grad_fn, k) for k, a in enumerate(aliases)], len(tensors))
    assert tree is not None
    return tree, call(*tensors).grad_fn


@pytest.mark.parametrize("name", ["layer_norm", "linear on 3-D", "mul"])
def test_a_known_tree_on_real_nodes_gets_the_same_hooks_both_ways(scan, name):
    x = torch.randn(2, 3, 16, requires_grad=True) * 1          # not a leaf
    w, b = torch.nn.Parameter(torch.randn(16, 16)), torch.nn.Parameter(torch.randn(16))
    g = torch.nn.Parameter(torch.randn(16))
    if name == "layer_norm":
        call, tensors = (lambda x, g, b: F.layer_norm(x, (16,), g, b)), (x, g, b)
    elif name == "linear on 3-D":
        call, tensors = F.linear, (x, w, b)
    else:
        call, tensors = torch.mul, (x, x * 2)
    tree, fn = _learned(call, *tensors)
    leaf = [t.is_leaf for t in tensors]
    inputs = list(tensors)
    found = B._hooks_of_py(tree, fn, inputs, leaf)
    assert found is not None and _hooks(B._hooks_of(tree, fn, inputs, leaf)) == _hooks(found)
    others = [torch.nn.Parameter(torch.randn(16)), torch.randn(2, 3, 16, requires_grad=True) * 1]
    wrong = [(t, inputs, leaf) for t in _altered(tree)]
    for k in range(len(inputs)):   # another tensor in a slot, leaf or not; a slot's leaf flag turned
        for other in others:
            wrong.append((tree, inputs[:k] + [other] + inputs[k + 1:], leaf))
        wrong.append((tree, inputs, leaf[:k] + [not leaf[k]] + leaf[k + 1:]))
    for t, ins, lf in wrong:
        assert _hooks(B._hooks_of_py(t, fn, ins, lf)) == _hooks(B._hooks_of(t, fn, ins, lf)), (t, lf)
    assert sum(B._hooks_of_py(t, fn, ins, lf) is None for t, ins, lf in wrong) >= len(wrong) // 2
