"""The compiled answer for calls the sampling skips (npu_agent/_fastskip.c, issue 25 goal 2): the same records,
names and counts as the Python path, under every sampling policy; and where a call is not plainly a skip it
changes nothing and leaves the decision to Python."""
from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn.functional as F

from npu_agent import PrecisionDebugger, fastskip, naming
from npu_agent.capture import CaptureMode, Capturer
from npu_agent.sampling import Policy, Sampler
from npu_agent.snapshot import HELD
from tests.support import ListSink, agent_config, built


@pytest.fixture(scope="module")
def compiled():
    """The compiled module, built here if the set-up did not build it (scripts/setup.sh does)."""
    return built(fastskip.SKIP)   # (fastskip.load() is SKIP.load())


class Block(torch.nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 2 * d)
        self.out = torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = F.gelu(self.fc(self.ln(x)))
        h = F.dropout(h, p=0.1, training=True)
        parts = torch.chunk(h, 2, dim=-1)
        h = torch.cat([parts[1], parts[0]], dim=-1)       # a list argument
        y = self.out(h) + x
        y.mul_(0.5)                                        # in place
        y = torch.softmax(y, dim=-1)                       # a keyword argument
        if step >= 5:                                      # a call site first met late
            y = y * torch.ones(y.shape[-1])
        if step % 3 == 2:                                  # a new shape every third step
            y = torch.matmul(y, torch.eye(y.shape[-1]))
        return y.sum()


def _train(tmp_path, tag: str, compiled_path: bool, steps: int = 14, **policy) -> tuple[list, dict, list, int]:
    folder = tmp_path / f"{tag}-folder"   # the shared-folder transport: no server, nothing to connect to
    folder.mkdir()
    cfg = agent_config(os.path.join(str(tmp_path), f"{tag}.json"), nfs_path=str(folder), online_close_timeout_s=1,
                       **policy)
    dbg = PrecisionDebugger(config_path=cfg)
    assert dbg._ensure_started() and dbg._capturer is not None
    cap = dbg._capturer
    sink = ListSink()
    cap.sink = sink.append
    assert cap.backward is not None
    cap.backward.sink = sink.append
    answered = [0]
    if compiled_path:
        real = cap.skip
        assert real is not None, "the compiled skip path is not in use"

        def counted(func, args, kwargs):
            skipped = real(func, args, kwargs)
            answered[0] += skipped
            return skipped

        cap.skip = counted
    else:
        cap.skip = None
    torch.manual_seed(0)
    model = Block()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    indices = []
    try:
        for step in range(steps):
            x = torch.randn(4, 16)
            dbg.start()
            model(x, step).backward()
            dbg.stop()
            indices.append(dict(cap._counts))
            opt.step()
            opt.zero_grad()
            dbg.step()
        counts = {k: v for k, v in cap.sampler.report().items() if "_us" not in k}   # not the timings
    finally:
        dbg.close()
    records = [(r.step, r.name, r.direction, r.module, r.skip_reason,
                [(t.shape, t.dtype, t.sum().item()) for t in _tensors(r)]) for r in sink]
    return records, counts, indices, answered[0]


def _tensors(rec) -> list[torch.Tensor]:
    out = []
    for field in ("inputs", "outputs"):
        snap = getattr(rec, field, None)
        for t in getattr(snap, "tensors", None) or ():
            if isinstance(t, torch.Tensor):
                out.append(t.float())
    return out


@pytest.mark.parametrize("policy", [
    {"online_sample_steps": 3},
    {"online_coverage_steps": 2},
    {"online_coverage_steps": 4, "online_sample_steps": 2},
])
def test_same_records_names_and_counts_as_the_python_path(tmp_path, compiled, policy):
    fast = _train(tmp_path, "fast", True, **policy)
    slow = _train(tmp_path, "slow", False, **policy)
    assert fast[0] == slow[0]   # the same records, in order, with the same names, modules and values
    assert fast[1] == slow[1]   # the sampler's counts
    assert fast[2] == slow[2]   # each step's call indices (the records' names)
    assert fast[1]["captured"] < fast[1]["calls"] and fast[0]
    assert fast[3] > 0 and slow[3] == 0   # the compiled path answered calls in the one run, none in the other


def _capturer(**policy) -> Capturer:
    """A capturer whose records are dropped at once: nothing they hold stays pending (HELD), once swept."""
    sampler = Sampler(Policy(**policy))
    return Capturer(lambda rec: None, sampler=sampler)


@pytest.fixture
def nothing_held():
    """HELD.pending is per process: the snapshots other tests left pending are set aside meanwhile (in place: the
    Skipper holds the same dict)."""
    saved = dict(HELD.pending)
    HELD.pending.clear()
    yield
    HELD.pending.update(saved)


def _sweep() -> None:
    gc.collect()
    HELD._sweep()


def _state(cap: Capturer) -> tuple:
    s = cap.sampler
    assert s is not None
    return dict(cap._counts), dict(s.counts), dict(s.last), set(s.seen)


def _skipping_capturer(compiled, **policy) -> tuple[Capturer, torch.Tensor, torch.Tensor]:
    """A capturer whose step 1 is not taken, after step 0 met linear(x, w)."""
    cap = _capturer(sample_steps=1 << 30, **policy)
    assert cap.skip is not None
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with CaptureMode(cap):
        F.linear(x, w)
    cap.next_step(1)
    return cap, x, w


def test_a_skipped_call_is_counted_as_python_counts_it(compiled):
    cap, x, w = _skipping_capturer(compiled)
    before = _state(cap)
    assert cap.skip(F.linear, (x, w), {}) is True
    after = _state(cap)
    assert after[0] == {**before[0], ("Functional", "linear"): before[0].get(("Functional", "linear"), 0) + 1}
    assert after[1]["calls"] == before[1]["calls"] + 1
    assert after[1]["skipped_steps"] == before[1]["skipped_steps"] + 1
    assert after[2:] == before[2:]


def test_what_is_not_plainly_a_skip_changes_nothing(compiled):
    cap, x, w = _skipping_capturer(compiled)
    before = _state(cap)
    cases = {
        "a new shape": (F.linear, (torch.randn(2, 8), w), {}),
        "a new dtype": (F.linear, (x.double(), w.double()), {}),
        "a callable not classified yet": (lambda a: a, (x,), {}),
        "not an API": (torch.Tensor.__repr__, (x,), {}),
    }
    for why, (func, args, kwargs) in cases.items():
        assert cap.skip(func, args, kwargs) is False, why
        assert _state(cap) == before, why
    with torch.no_grad():   # another direction: another call site
        assert cap.skip(F.linear, (x, w), {}) is False and _state(cap) == before


def test_a_call_that_writes_what_a_record_holds_goes_to_python(compiled, nothing_held):
    cap, x, w = _skipping_capturer(compiled)
    y = torch.randn(4, 8)
    with CaptureMode(cap):   # meets add_ and add(out=) in a step not taken: new sites, decided by Python
        y.add_(1.0)
        torch.add(x, x, out=y)
    _sweep()
    assert not HELD.pending
    before = _state(cap)
    assert cap.skip(torch.Tensor.add_, (y, 1.0), {}) is True   # nothing held: a plain skip
    before = _state(cap)
    key = object()
    HELD.pending[id(key)] = lambda: None   # a record holds tensors: the Python path protects them first
    try:
        assert cap.skip(torch.Tensor.add_, (y, 1.0), {}) is False
        assert cap.skip(torch.add, (x, x), {"out": y}) is False
        assert _state(cap) == before
        assert cap.skip(F.linear, (x, w), {}) is True   # writes nothing: still a skip
    finally:
        del HELD.pending[id(key)]


def test_calls_that_are_no_api_run_as_they_are_and_change_nothing(compiled, nothing_held):
    """A property's getter (`x.shape` reaches the mode as `Tensor.shape.__get__`, a method-wrapper made anew at each
    access) and a call classified as no API while no record holds a tensor: True (run it), nothing counted, as the
    Python path only runs them; the same call while a record holds tensors, a setter, or a getter given `out=`:
    Python's to decide."""
    cap, x, w = _skipping_capturer(compiled)
    _sweep()
    assert not HELD.pending
    getter = torch.Tensor.shape.__get__
    assert type(getter).__name__ == "method-wrapper" and getter is not torch.Tensor.shape.__get__   # made anew
    assert naming.classify(torch.Tensor._is_view) is None   # (cached as no API)
    before = _state(cap)
    assert cap.skip(getter, (x,), None) is True and _state(cap) == before
    assert cap.skip(torch.Tensor.dtype.__get__, (x,), {}) is True and _state(cap) == before
    assert cap.skip(torch.Tensor._is_view, (x,), None) is True and _state(cap) == before
    assert cap.skip(torch.Tensor.requires_grad.__set__, (x, False), None) is False and _state(cap) == before
    assert cap.skip(getter, (x,), {"out": w}) is False and _state(cap) == before
    key = object()
    HELD.pending[id(key)] = lambda: None   # a record holds tensors: the Python path decides whether it protects them
    try:
        assert cap.skip(torch.Tensor._is_view, (x,), None) is False and _state(cap) == before
        assert cap.skip(getter, (x,), None) is True   # a getter writes nothing, held or not
    finally:
        del HELD.pending[id(key)]


def test_the_python_path_runs_a_getter_unrecorded():
    """Without a sampler (every call captured, no compiled skip) a property's getter is run at once, recorded as
    nothing, whatever the records hold."""
    sink = ListSink()
    cap = Capturer(sink.append)
    assert cap.skip is None
    x = torch.randn(3, 4, requires_grad=True)
    with CaptureMode(cap):
        y = x * 2.0
        shape, dtype, grad_fn = y.shape, y.dtype, y.grad_fn
    assert shape == (3, 4) and dtype == torch.float32 and grad_fn is not None
    assert [r.name for r in sink] == ["Tensor.mul.0"]


def test_a_backward_pass_goes_to_python(compiled):
    cap, x, w = _skipping_capturer(compiled)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 1.0

        @staticmethod
        def backward(ctx, g):
            before = _state(cap)
            seen.append(cap.skip(F.linear, (x, w), {}))
            assert _state(cap) == before
            return g

    a = torch.randn(4, 8, requires_grad=True)
    Probe.apply(a).sum().backward()
    assert seen == [False]


def test_repeats_within_the_coverage_period_are_skipped_and_due_calls_go_to_python(compiled):
    cap = _capturer(coverage_steps=3)
    assert cap.skip is not None
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with CaptureMode(cap):
        F.linear(x, w)   # step 0: captured
    results = []
    for step in range(1, 7):
        cap.next_step(step)
        taken = cap.sampler.step_taken
        before = _state(cap)
        got = cap.skip(F.linear, (x, w), {}) if taken else None
        if got is False:
            assert _state(cap) == before
            with CaptureMode(cap):
                F.linear(x, w)   # Python captures it
        results.append((step, taken, got))
    due = {s for s, taken, got in results if taken and got is False}
    repeats = {s for s, taken, got in results if got is True}
    assert due and repeats and cap.sampler.counts["skipped_repeats"] >= len(repeats)
    assert all(s % 3 == 0 for s in due)


def test_no_skipper_without_a_sampler_or_with_a_scope_or_a_list(compiled):
    assert Capturer(ListSink().append).skip is None
    assert Capturer(ListSink().append, sampler=Sampler(Policy(sample_steps=2)), scope=("a", "b")).skip is None
    assert Capturer(ListSink().append, sampler=Sampler(Policy(sample_steps=2)), api_list=("linear",)).skip is None


def test_pure_python_when_asked_or_not_built(monkeypatch, tmp_path, compiled):
    monkeypatch.setattr(fastskip.SKIP, "loaded", [])
    monkeypatch.setenv(fastskip.PURE_PYTHON_ENV, "1")
    assert fastskip.load() is None
    assert _capturer(sample_steps=2).skip is None
    monkeypatch.setattr(fastskip.SKIP, "loaded", [])
    monkeypatch.delenv(fastskip.PURE_PYTHON_ENV)
    monkeypatch.setattr(fastskip.SKIP, "source", tmp_path / "_fastskip.c")   # a changed source: its binary is not built
    (tmp_path / "_fastskip.c").write_text("/* another source */\n")
    assert fastskip.load() is None


def test_the_binary_is_named_by_its_source(tmp_path, monkeypatch):
    src = tmp_path / "_fastskip.c"
    src.write_text("int a;\n")
    monkeypatch.setattr(fastskip.SKIP, "source", src)
    first = fastskip.SKIP.binary_path()
    src.write_text("int b;\n")
    assert fastskip.SKIP.binary_path() != first and first.parent == tmp_path


def test_the_skips_counted_in_c_reach_the_sampler_once_when_its_counts_are_read(compiled):
    cap, x, w = _skipping_capturer(compiled)
    sampler = cap.sampler
    assert sampler is not None
    before = dict(sampler.counts)
    for _ in range(1000):
        assert cap.skip(F.linear, (x, w), {}) is True
    assert sampler._counts["calls"] == before["calls"]          # kept on the C side meanwhile ...
    after = sampler.counts                                       # ... and added when the counts are read
    assert after["calls"] == before["calls"] + 1000 and after["skipped_steps"] == before["skipped_steps"] + 1000
    assert sampler.counts == after                               # once
    for _ in range(10):
        assert cap.skip(F.linear, (x, w), {}) is True
    assert sampler.report()["calls"] == before["calls"] + 1010   # the report reads them too
