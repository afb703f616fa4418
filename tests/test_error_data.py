"""error_data_path online: a failing call's inputs, outputs and gradients are saved (safetensors) with a script that
replays that one call."""
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from gpu_server.checker import Checker
from gpu_server.error_data import load
from gpu_server.summary import Summary
from tests.support import ROOT, capture, read_csv, to_job


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
    checker = Checker(str(out), "20260101000000", torch.device("cpu"), Summary(), 1 << 30,
                      error_data_base=str(out))
    for rec in sink:
        checker.check(to_job(rec))
    checker.close()
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
    checker = Checker(str(tmp_path), "20260101000000", torch.device("cpu"), Summary(), backward_budget=1)
    for rec in sink:
        checker.check(to_job(rec))
    checker.close()
    results = {r["API name"]: r for r in read_csv(str(tmp_path), "accuracy_checking_result")}
    assert len(results) == 4
    skipped = [r for r in results.values() if r["Backward Test Success"] == "SKIP"]
    assert skipped and all("--backward-memory-mb" in r["Message"] for r in skipped)
    assert all(r["Forward Test Success"] == "pass" for r in results.values())
