"""error_data_path online: a failing call's inputs, outputs and gradients are saved (safetensors) with a script that
replays that one call."""
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from gpu_server.checking.checker import Checker
from gpu_server.checking.pending import PendingCalls
from gpu_server.checking.workers import Worker
from gpu_server.reports.error_data import Evidence, load
from gpu_server.reports.rank_reports import Reports
from gpu_server.reports.summary import Summary
from tests.support import ROOT, capture, read_csv, to_job

TS = "20260101000000"


def _worker(out, backward_budget: int = 1 << 30, evidence: Evidence | None = None) -> Worker:
    """One server worker, in this thread: PendingCalls decides, the Checker computes, Reports writes."""
    summary = Summary()
    return Worker(Checker(torch.device("cpu"), summary, evidence=evidence), Reports(str(out), TS, summary.add_files),
                  PendingCalls(backward_budget))


def test_failing_call_is_saved_and_replayable(tmp_path):
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            y = F.linear(x, w)
            z = F.gelu(y)
        z.sum().backward()
    bad = sink.forward("Functional.gelu.0")
    bad.output.tree = bad.output.tree * 1.05           # a device that computes gelu 5 % too large
    out = tmp_path / "out"
    out.mkdir()
    worker = _worker(out, evidence=Evidence(str(out), TS))
    for rec in sink:
        worker.check(to_job(rec))
    worker.close()
    results = {r["API name"]: r for r in read_csv(str(out), "accuracy_checking_result")}
    assert results["Functional.gelu.0"]["Forward Test Success"] == "error"
    assert results["Functional.linear.0"]["Forward Test Success"] == "pass"
    folder = out / "error_data" / "20260101000000" / "test" / "rank0" / "Functional.gelu.0.step0"   # per run id
    assert sorted(os.listdir(folder)) == ["call.json", "replay.py", "tensors.safetensors"]
    assert not (out / "error_data" / "20260101000000" / "test" / "rank0" / "Functional.linear.0.step0").exists()
    fwd, bwd = load(str(folder))
    assert torch.equal(fwd.args[0], y.detach()) and bwd is not None and len(bwd.grad_input) == 1
    proc = subprocess.run([sys.executable, str(folder / "replay.py")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "forward.output.0: error" in proc.stdout and "backward.output.0: pass" in proc.stdout


def test_evicted_forward_inputs_give_a_backward_skip_naming_the_limit(tmp_path):
    lin1, lin2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
    x = torch.randn(32, 64, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            loss = lin2(F.relu(lin1(x))).sum()
        loss.backward()
    worker = _worker(tmp_path, backward_budget=1)
    for rec in sink:
        worker.check(to_job(rec))
    worker.close()
    results = {r["API name"]: r for r in read_csv(str(tmp_path), "accuracy_checking_result")}
    assert len(results) == 4
    skipped = [r for r in results.values() if r["Backward Test Success"] == "SKIP"]
    assert skipped and all("--backward-memory-mb" in r["Message"] for r in skipped)
    assert all(r["Forward Test Success"] == "pass" for r in results.values())


def _failing_gelus(n: int, size: int) -> list:
    """n captured gelu calls on (size, size) float32 tensors, each output 5 % too large (a faulty device)."""
    xs = [torch.randn(size, size) for _ in range(n)]
    with capture(backward=False) as (mode, sink):
        with mode:
            for x in xs:
                F.gelu(x)
    for i in range(n):
        bad = sink.forward(f"Functional.gelu.{i}")
        bad.output.tree = bad.output.tree * 1.05
    return list(sink)


def _check_all(out, records, evidence) -> dict:
    worker = _worker(out, evidence=evidence)
    for rec in records:
        worker.check(to_job(rec))
    worker.close()
    return {r["API name"]: r for r in read_csv(str(out), "accuracy_checking_result")}


def _du(path) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def test_default_cap_is_a_gib_or_a_quarter_of_the_free_space(tmp_path, monkeypatch):
    from gpu_server.reports import error_data

    st = os.statvfs(tmp_path)
    assert error_data.default_max_bytes(str(tmp_path)) == min(1 << 30, st.f_bavail * st.f_frsize // 4)
    assert error_data.default_max_bytes(str(tmp_path / "not" / "made" / "yet")) == min(
        1 << 30, st.f_bavail * st.f_frsize // 4)          # measured on the nearest folder that exists
    monkeypatch.setattr(error_data, "_free_bytes", lambda path: 100 << 30)
    assert Evidence(str(tmp_path), "ts").max_bytes == 1 << 30          # a large disk: 1 GiB
    monkeypatch.setattr(error_data, "_free_bytes", lambda path: 8 << 20)
    assert Evidence(str(tmp_path), "ts").max_bytes == 2 << 20          # 8 MiB free: a quarter
    monkeypatch.setattr(error_data, "_free_bytes", lambda path: None)
    assert Evidence(str(tmp_path), "ts").max_bytes == 1 << 30          # not measurable: 1 GiB
    assert Evidence(str(tmp_path), "ts", 5 << 20).max_bytes == 5 << 20  # an explicit --error-data-max-mb wins


def test_past_the_default_cap_failing_calls_are_reported_without_their_tensors(tmp_path, monkeypatch, caplog):
    """No --error-data-max-mb and little free space (4 MiB, mocked): the cap is 1 MiB. Each failing gelu call
    needs 512 KiB of tensors (input and output, 256x256 float32): the first is saved, the next ones would pass the
    cap and are not, yet every call is reported as failing; the folder stays under the cap."""
    from gpu_server.reports import error_data

    monkeypatch.setattr(error_data, "_free_bytes", lambda path: 4 << 20)
    out = tmp_path / "out"
    out.mkdir()
    evidence = Evidence(str(out), "20260101000000")
    assert evidence.max_bytes == 1 << 20
    with caplog.at_level("WARNING", logger="gpu_server"):
        results = _check_all(out, _failing_gelus(3, 256), evidence)
    assert [results[f"Functional.gelu.{i}"]["Forward Test Success"] for i in range(3)] == ["error"] * 3
    rank = out / "error_data" / "20260101000000" / "test" / "rank0"
    assert sorted(os.listdir(rank)) == ["Functional.gelu.0.step0"]
    assert (evidence.saved, evidence.skipped) == (1, 2)
    assert _du(out / "error_data") <= evidence.max_bytes
    said = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
    assert len(said) == 1 and "default cap" in said[0] and "--error-data-max-mb" in said[0], said


def test_a_call_larger_than_the_cap_is_never_saved_and_zero_saves_none(tmp_path):
    """The cap holds before anything is written: one call whose tensors alone pass it is not saved, even first;
    --error-data-max-mb 0 saves nothing. The calls are still reported."""
    for cap, name in ((256 << 10, "small"), (0, "zero")):
        out = tmp_path / name
        out.mkdir()
        evidence = Evidence(str(out), "20260101000000", cap)
        results = _check_all(out, _failing_gelus(1, 256), evidence)
        assert results["Functional.gelu.0"]["Forward Test Success"] == "error"
        assert (evidence.saved, evidence.skipped) == (0, 1)
        assert not (out / "error_data").exists() or _du(out / "error_data") == 0
