"""Where each captured call was made (npu_agent/location.py): its module path and the user's source line, on the
records, on the wire and in the four CSV reports."""
from __future__ import annotations

import inspect
import os
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as torch_module

from gpu_server.columns import EXTRA_COLUMNS
from gpu_server.decode import MAX_WHERE, decode_job
from npu_agent import location
from npu_agent.compiled import LOCATE
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from tests.support import Server, agent_config, built, capture, read_csv, read_header, run_training, to_job

HERE = os.path.relpath(__file__) if os.path.abspath(__file__).startswith(os.getcwd() + os.sep) else __file__


def _line() -> int:
    """The line number of the caller's line."""
    return inspect.currentframe().f_back.f_lineno


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()

    def forward(self, x):
        return F.gelu(self.attn(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.fixture(params=["frames in C", "frames in Python", "hooks"])
def hooks(request, monkeypatch):
    """Modules followed as the agent does: read off the frames (by npu_agent/_fastlocate.c, built here if the set-up
    did not build it, and by the Python walk that runs where it is not built), and, where torch has no
    `nn.Module._call_impl`, with global hooks (the fallback, forced here)."""
    monkeypatch.setattr(location, "_loaded", True)
    monkeypatch.setattr(location, "_compiled_walk", _compiled_walk() if request.param == "frames in C" else None)
    if request.param == "hooks":
        monkeypatch.setattr(location, "_CALL_IMPL", None)
    location.install()
    yield
    location.uninstall()


def _compiled_walk():
    module = built(LOCATE)
    assert hasattr(module, "modules"), "npu_agent/_fastlocate.c did not load"
    return module.modules


def _by(sink, direction=1):
    return {r.name: r for r in sink if r.direction == direction}


def test_module_path_of_nested_modules_and_module_list_indices(hooks):
    model = TinyLM()
    with capture() as (mode, sink):
        with mode:
            model(torch.randn(2, 4))
    fwd = _by(sink)
    assert fwd["Functional.linear.0"].module == "TinyLM.blocks.0.attn.proj"
    assert fwd["Functional.linear.1"].module == "TinyLM.blocks.1.attn.proj"
    assert fwd["Functional.gelu.0"].module == "TinyLM.blocks.0"
    assert fwd["Functional.gelu.1"].module == "TinyLM.blocks.1"
    assert fwd["Tensor.sum.0"].module == "TinyLM"
    assert location.module_path() == ""   # every module popped


def test_a_module_called_alone_and_calls_outside_any_module(hooks):
    lin = nn.Linear(4, 4)
    with capture() as (mode, sink):
        with mode:
            x = torch.randn(2, 4)
            lin(x)
            x.relu()
            Block()(x)   # called on its own: its class name is the root
    fwd = _by(sink)
    assert fwd["Functional.linear.0"].module == "Linear"
    assert fwd["Tensor.relu.0"].module == ""
    assert fwd["Torch.randn.0"].module == ""
    assert fwd["Functional.linear.1"].module == "Block.attn.proj"
    assert fwd["Functional.gelu.0"].module == "Block"


def test_a_module_that_raises_is_popped(hooks):
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            self.inner(x)
            raise ValueError("boom")

    with pytest.raises(ValueError):
        Bad()(torch.randn(1, 4))
    assert location.module_path() == "" and location._STACK.modules == []


def test_a_child_that_is_not_a_submodule_of_its_caller_is_named_by_its_class(hooks):
    shared = nn.Linear(4, 4)

    class Caller(nn.Module):
        def forward(self, x):
            return shared(x)   # not registered under Caller

    with capture() as (mode, sink):
        with mode:
            Caller()(torch.randn(1, 4))
    assert _by(sink)["Functional.linear.0"].module == "Caller.Linear"


def test_source_points_at_the_users_line_not_torchs():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with capture() as (mode, sink):
        with mode:
            y = torch.relu(x); relu_line = _line()   # noqa: E702 - the call and its line number on one line
            lin(y); linear_line = _line()            # noqa: E702 - F.linear runs inside torch's Linear.forward
    fwd = _by(sink)
    me = "test_source_points_at_the_users_line_not_torchs"
    assert fwd["Torch.relu.0"].source == f"{HERE}:{relu_line} ({me})"
    assert fwd["Functional.linear.0"].source == f"{HERE}:{linear_line} ({me})"
    assert "torch" not in fwd["Functional.linear.0"].source.split(":")[0]


def test_backward_records_carry_their_forward_calls_location(hooks):
    model = TinyLM()
    x = torch.randn(2, 4, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            loss = model(x)
        loss.backward()
    fwd, bwd = _by(sink), _by(sink, 2)
    assert bwd, "no backward records"
    for name, rec in bwd.items():
        assert (rec.module, rec.source) == (fwd[name].module, fwd[name].source), name
    assert bwd["Functional.linear.1"].module == "TinyLM.blocks.1.attn.proj"
    assert bwd["Functional.linear.1"].source.endswith("(forward)")


def test_skipped_records_are_located_too(hooks):
    with capture() as (mode, sink):
        with mode:
            torch.randn(3, 4).dim_order(); line = _line()   # noqa: E702 - not replayable: a SKIP record
    rec = sink.forward("Tensor.dim_order.0")
    assert rec.skip_reason and rec.source == f"{HERE}:{line} (test_skipped_records_are_located_too)"


def test_location_failures_never_reach_the_training(monkeypatch, hooks):
    monkeypatch.setattr(location, "module_path", lambda: 1 / 0)
    with capture() as (mode, sink):
        with mode:
            torch.randn(3).relu()
    assert [(r.module, r.source) for r in sink] == [("", ""), ("", "")]


def test_the_debugger_installs_the_hooks_only_while_started_and_removes_them(tmp_path):
    from npu_agent import PrecisionDebugger

    before = (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks))
    (tmp_path / "nfs").mkdir()
    dbg = PrecisionDebugger(config_path=agent_config(str(tmp_path / "agent.json"), nfs_path=str(tmp_path / "nfs")))
    assert not location.installed()
    model = nn.Sequential(nn.Linear(2, 2))
    assert location.module_path() == ""
    dbg.start()
    assert location.installed()
    # no global module hooks: torch keeps its fast path for every module call the agent does not capture
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == before
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(location.module_path()))
    model(torch.randn(1, 2))
    dbg.stop()
    assert seen == ["Sequential.0"]
    assert not location.installed()
    model(torch.randn(1, 2))
    assert seen == ["Sequential.0", ""]   # not followed while stopped
    dbg.start()
    assert location.installed()
    dbg.close()
    assert not location.installed()
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == before


def test_the_hooks_fallback_installs_and_removes_global_hooks(monkeypatch):
    """On a torch without `nn.Module._call_impl`, the module stack is kept by global hooks, only while installed."""
    monkeypatch.setattr(location, "_CALL_IMPL", None)
    before = (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks))
    location.install()
    try:
        assert len(torch_module._global_forward_pre_hooks) == before[0] + 1
        assert len(torch_module._global_forward_hooks) == before[1] + 1
    finally:
        location.uninstall()
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == before


def test_module_and_source_cross_the_wire_bounded():
    rec = PendingRecord(name="Torch.relu.0", step=0, seq=0, module="TinyLM.blocks.0", source="train.py:3 (forward)")
    rec.inputs = snapshot(((torch.randn(2),), {}))
    rec.output = snapshot(torch.randn(2))
    job = to_job(rec)
    assert (job.module, job.source) == ("TinyLM.blocks.0", "train.py:3 (forward)")
    long = PendingRecord(name="Torch.relu.1", step=0, seq=1, module="m" * 2000, source="s" * 600)
    _ = encode_record(long, "run", 0)
    record = _.record
    assert len(record.header.module) == len(record.header.source) == location.MAX_TEXT


def test_the_server_keeps_an_odd_module_or_source_cut_and_escaped():
    rec = PendingRecord(name="Torch.relu.0", step=0, seq=0)
    rec.inputs = snapshot(((torch.randn(2),), {}))
    rec.output = snapshot(torch.randn(2))
    enc = encode_record(rec, "run", 0)
    record = enc.record
    record.header.module = "a\nb" * 1000           # longer than the server keeps, with newlines
    record.header.source = "train.py:1 (\x1b[31mforward\u202e)"
    job = decode_job(record, bytes(enc.buffers[0][1]) if enc.buffers else b"")
    assert len(job.module) <= MAX_WHERE * 2 + 3 and "\n" not in job.module and job.module.startswith("a\\nb")
    assert "\x1b" not in job.source and "\u202e" not in job.source and job.source.startswith("train.py:1 (")


def test_report_rows_carry_seq_module_and_source(tmp_path):
    from gpu_server import reports
    from gpu_server.reports.rank_reports import NOWHERE, RankReports, Where, detail_row, result_row

    rep = RankReports(str(tmp_path), "20240101000000", 0)
    rep.write([result_row("Torch.relu.0", "pass", " ", "", 3,
                          where=Where(7, "TinyLM.blocks.0", "train.py:9 (forward)"))])
    rep.write([result_row("Torch.relu.1", "pass", " ", "", 3)])
    rep.write([detail_row("Torch.relu.0.forward.output.0", "torch.float32", "torch.float32", "(2,)", None, "pass",
                          "", 3, where=Where(7, "=cmd()", "t.py:1 (f)"))])
    rep.close()
    assert NOWHERE == Where()
    assert read_header(str(tmp_path), "accuracy_checking_result")[-4:] == EXTRA_COLUMNS
    rows = read_csv(str(tmp_path), "accuracy_checking_result")
    assert [(r["Step"], r["Seq"], r["Module"], r["Source"]) for r in rows] == [
        ("3", "7", "TinyLM.blocks.0", "train.py:9 (forward)"), ("3", " ", " ", " ")]
    details = read_csv(str(tmp_path), "accuracy_checking_details")
    assert details[0]["Module"] == "'=cmd()"   # never a spreadsheet formula
    frame = reports.load(str(tmp_path), "result")
    assert str(frame["Seq"].dtype) == "Int64" and frame["Seq"].isna().tolist() == [False, True]
    assert frame["Module"].tolist() == ["TinyLM.blocks.0", ""] and frame["source"].tolist()[1] == ""


# -- end to end: a real server, a training script in a file ---------------------------------------------------------
SCRIPT = r'''
import sys, torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)  # PROJ


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()

    def forward(self, x):
        return F.gelu(self.attn(x))  # GELU


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


torch.manual_seed(0)
model = TinyLM()
dbg = PrecisionDebugger(config_path=sys.argv[1])
for step in range(2):
    dbg.start()
    loss = model(torch.randn(4, 8))
    loss.backward()
    dbg.stop()
    dbg.step()
dbg.close()
'''
RUN_FILE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def test_reports_name_the_module_and_the_training_scripts_line_forward_and_backward(tmp_path):
    script = tmp_path / "train_where.py"
    script.write_text(SCRIPT)
    lines = SCRIPT.splitlines()
    proj = next(i for i, t in enumerate(lines, 1) if t.endswith("# PROJ"))
    gelu = next(i for i, t in enumerate(lines, 1) if t.endswith("# GELU"))
    with Server(str(tmp_path)) as srv:
        cfg = agent_config(str(tmp_path / "agent.json"), srv.port)
        run_training(RUN_FILE, str(script), cfg, cwd=str(tmp_path))
        srv.stop()
    want = {"Functional.linear": ("TinyLM.blocks.{}.attn.proj", f"train_where.py:{proj} (forward)"),
            "Functional.gelu": ("TinyLM.blocks.{}", f"train_where.py:{gelu} (forward)")}
    results = read_csv(srv.out, "accuracy_checking_result")
    details = read_csv(srv.out, "accuracy_checking_details")
    assert results and details
    for rows, name_column in ((results, "API name"), (details, "API Name")):
        seen = set()
        for r in rows:
            assert r["Seq"].strip().isdigit(), r
            api, n = r[name_column].split(".")[:2], int(r[name_column].split(".")[2])
            if ".".join(api) in want:
                module, source = want[".".join(api)]
                assert (r["Module"], r["Source"]) == (module.format(n % 2), source), r
                seen.add(r[name_column].split(".output.")[0].rsplit(".", 1)[-1] if name_column == "API Name"
                         else "result")
            elif r[name_column].startswith("Tensor.pow"):
                assert r["Module"] == "TinyLM" and r["Source"].startswith("train_where.py:"), r
        assert seen == ({"forward", "backward"} if name_column == "API Name" else {"result"}), seen


def test_the_compiled_walk_finds_the_modules_the_python_walk_finds():
    """npu_agent/_fastlocate.c `modules` against location._walk, from frames in awkward places: a module that calls
    itself, a forward hook that calls another module, a generator run inside a forward, a thread's own stack, and a
    frame that has finished (left to Python: None)."""
    walk, target = _compiled_walk(), location._CALL_IMPL
    seen: list[tuple[str, list[int], object]] = []

    def look(what, frame):
        python = [id(m) for m in location._walk(frame, target)]
        c = walk(frame, target, nn.Module)
        seen.append((what, python, None if c is None else [id(m) for m in c]))

    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.leaf = nn.Linear(2, 2)

        def forward(self, x, depth=2):
            if depth:
                return self(x, depth - 1)   # the same module again, inside itself
            look("recursion", inspect.currentframe())
            return self.leaf(x)

    def rows():
        look("generator", inspect.currentframe())
        yield 1

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.deep = Deep()
            self.other = nn.Identity()

        def forward(self, x):
            sum(rows())
            self.frame = inspect.currentframe()   # finished once forward returns
            return self.deep(x)

    outer = Outer()
    outer.deep.leaf.register_forward_hook(lambda m, i, o: (look("hook", inspect.currentframe()), outer.other(o))[1])
    outer.other.register_forward_hook(lambda m, i, o: look("hook's module", inspect.currentframe()))
    outer(torch.randn(1, 2))
    thread = threading.Thread(target=lambda: outer.deep(torch.randn(1, 2), 0))
    thread.start()
    thread.join()
    look("finished", outer.frame)
    whats = [what for what, _, _ in seen]
    assert whats == ["generator", "recursion", "hook", "hook's module", "recursion", "hook", "hook's module",
                     "finished"], whats
    for what, python, c in seen[:-1]:
        assert c == python and python, (what, python, c)
    o, d, leaf, other = id(outer), id(outer.deep), id(outer.deep.leaf), id(outer.other)
    assert seen[0][1] == [o] and seen[1][1] == [d, d, d, o]   # Deep three times, inside Outer
    assert seen[2][1] == [leaf, d, d, d, o] and seen[3][1] == [other, leaf, d, d, d, o]
    assert [s[1] for s in seen[4:7]] == [[d], [leaf, d], [other, leaf, d]]   # on the thread's own stack
    assert seen[7][2] is None and seen[7][1] == [o], seen[7]   # finished: Python follows its f_back


def test_python_walks_when_asked_or_the_module_is_not_built(monkeypatch, tmp_path):
    """ONLINE_CHECK_PURE_PYTHON=1, or a source whose binary is not built: install() leaves the walk to Python, and
    module paths come out the same."""
    from npu_agent import compiled

    def loaded_walk():
        monkeypatch.setattr(location, "_loaded", False)
        monkeypatch.setattr(location, "_compiled_walk", None)
        monkeypatch.setattr(LOCATE, "loaded", [])
        location.install()
        location.uninstall()
        return location._compiled_walk

    _compiled_walk()   # built, as the set-up builds it
    assert loaded_walk() is not None
    monkeypatch.setenv(compiled.PURE_PYTHON_ENV, "1")
    assert loaded_walk() is None
    monkeypatch.delenv(compiled.PURE_PYTHON_ENV)
    monkeypatch.setattr(LOCATE, "source", tmp_path / "_fastlocate.c")   # a changed source: its binary is not built
    (tmp_path / "_fastlocate.c").write_text("/* another source */\n")
    assert loaded_walk() is None
    monkeypatch.setattr(location, "_loaded", True)   # (install() below: the Python walk stays)
    location.install()
    try:
        model = TinyLM()
        with capture() as (mode, sink):
            with mode:
                model(torch.randn(2, 4))
        assert _by(sink)["Functional.linear.1"].module == "TinyLM.blocks.1.attn.proj"
    finally:
        location.uninstall()
