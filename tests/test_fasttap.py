"""A captured call's flat arguments read in C (npu_agent/_fasttap.c, issue 25 goal 2): `scan` appends exactly what
the Python path (backward._scan_py) appends to the call's signature and returns the same tensors to tap, or None
where it does, for every kind of argument; a training captured with it makes the same records, forward and backward,
as one captured with the Python path; and the Python path runs where the module is not built or not wanted."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from npu_agent import PrecisionDebugger
from npu_agent import backward as B
from npu_agent.compiled import PURE_PYTHON_ENV, TAP
from npu_agent.snapshot import KIND_OF, iter_tensors
from tests.support import ListSink, agent_config


@pytest.fixture(scope="module")
def scan():
    """The compiled `scan`, built here if the set-up did not build it (scripts/setup.sh does)."""
    if not TAP.binary_path().exists():
        TAP.build(quiet=True)
    TAP.loaded.clear()
    found = B._scanner()
    assert found is not B._scan_py, "npu_agent/_fasttap.c did not load"
    return found


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
    if py is not None:
        assert [(k, id(t), pos) for k, t, pos in py] == [(k, id(t), pos) for k, t, pos in c]
        assert _same(py_sig, c_sig), (py_sig, c_sig)
    else:   # the read ended at the same argument
        assert _same(py_sig, c_sig), (py_sig, c_sig)


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


def _train(tmp_path, tag: str, compiled: bool, steps: int = 4) -> list:
    folder = tmp_path / f"{tag}-folder"
    folder.mkdir()
    cfg = agent_config(os.path.join(str(tmp_path), f"{tag}.json"), nfs_path=str(folder), online_close_timeout_s=1)
    dbg = PrecisionDebugger(config_path=cfg)
    assert dbg._ensure_started() and dbg._capturer is not None and dbg._capturer.backward is not None
    cap = dbg._capturer
    sink = ListSink()
    cap.sink = cap.backward.sink = sink.append
    if not compiled:
        cap.backward._scan = B._scan_py
    assert (cap.backward._scan is B._scan_py) != compiled
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
        grads = [g for snap in (r.grad_input, r.grad_output) if snap is not None for g in iter_tensors(snap.tree)]
        records.append((r.step, r.name, r.direction, r.backward_expected, r.module, r.skip_reason,
                        [(g.shape, g.dtype, g.double().sum().item()) for g in grads]))
    return [records, known]


def test_a_training_makes_the_same_records_either_way(tmp_path, scan):
    fast, slow = _train(tmp_path, "fast", True), _train(tmp_path, "slow", False)
    assert fast[0] == slow[0]   # names, directions, modules, and every gradient of every backward record
    assert fast[1] == slow[1] > 0   # the same calls learned as known trees (the signatures are the same)
    assert any(r[2] == 2 and r[6] for r in fast[0]), "no backward record with gradients: the test proves nothing"


def test_the_python_path_when_asked_or_not_built(monkeypatch, tmp_path, scan):
    monkeypatch.setattr(TAP, "loaded", [])
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    assert B._scanner() is B._scan_py
    monkeypatch.setattr(TAP, "loaded", [])
    monkeypatch.delenv(PURE_PYTHON_ENV)
    monkeypatch.setattr(TAP, "source", tmp_path / "_fasttap.c")   # a changed source: its binary is not built
    (tmp_path / "_fasttap.c").write_text("/* another source */\n")
    assert B._scanner() is B._scan_py
