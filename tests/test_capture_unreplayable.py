"""Calls the server will never replay (not in protos/apis.py's allowlist by name) are decided at capture time: sent
without tensors, with the reason as skip_reason; the server reports them SKIP and acknowledges them ACCEPTED."""
from __future__ import annotations

import torch

from tests.support import Server, agent_config, by_name, capture, read_csv, run_training

TRAIN = r"""
import sys, torch
from npu_agent import PrecisionDebugger
torch.manual_seed(0)
dbg = PrecisionDebugger(config_path=sys.argv[1])
model = torch.nn.Linear(4, 3)
x = torch.randn(2, 4, requires_grad=True)
dbg.start()
y = model(x)
assert y.dim_order() == (0, 1) and x.dim_order() == (0, 1)
n = str(torch.result_type(y, 1))
loss = y.relu().sum()
loss.backward()
dbg.stop()
dbg.close()
print("RESULT_TYPE", n)
"""


def test_unreplayable_call_is_recorded_skipped_without_tensors_or_taps():
    x = torch.randn(3, 4, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            y = x * 2
            assert y.dim_order() == (0, 1)   # Tensor.dim_order: captured, not in the allowlist
            y.sum().backward()
    rec = sink.forward("Tensor.dim_order.0")
    assert rec.skip_reason.startswith("not replayable: Tensor.dim_order is not an API in the server's allowlist")
    assert rec.inputs is None and rec.output is None   # nothing snapshotted
    assert not rec.backward_expected and "Tensor.dim_order.0" not in sink.names(direction=2)
    assert sink.forward("Tensor.mul.0").skip_reason == "" and sink.forward("Tensor.mul.0").inputs is not None
    assert x.grad is not None and torch.equal(x.grad, torch.full((3, 4), 2.0))   # the training is unchanged


def test_unreplayable_calls_get_skip_rows_with_the_reason_and_no_agent_warning(tmp_path):
    with Server(str(tmp_path)) as srv:
        proc = run_training(TRAIN, agent_config(str(tmp_path / "agent.json"), srv.port))
        srv.stop()
    assert "RESULT_TYPE torch.float32" in proc.stdout
    assert "rejected" not in proc.stderr.lower(), proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    rows = by_name(read_csv(srv.out, "accuracy_checking_result"))
    for name in ("Tensor.dim_order.0", "Tensor.dim_order.1", "Torch.result_type.0"):
        assert rows[name]["Forward Test Success"] == "SKIP", rows.get(name)
        api = name.rsplit(".", 1)[0]
        assert f"not replayable: {api} is not an API in the server's allowlist" in rows[name]["Message"], rows[name]
    assert rows["Functional.linear.0"]["Forward Test Success"] == "pass", rows["Functional.linear.0"]
    assert rows["Tensor.relu.0"]["Forward Test Success"] == "pass", rows["Tensor.relu.0"]
