"""A float16 training that overflows is not accused (docs/standards.md, "Non-finite values"): a real server, a real
training whose first linear overflows float16 inside the checked region, then carries inf/NaN through its loss,
backward and AdamW update into the next step. The summary names the first overflowing call and says whose it is."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from tests.support import ROOT, Server, agent_config, read_csv, run_training

OVERFLOW = r'''
import sys, torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).half()
with torch.no_grad():
    model[0].weight[:4] = 20000.0     # four outputs of the first linear exceed float16's 65504
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
dbg = PrecisionDebugger(config_path=sys.argv[1])
g = torch.Generator().manual_seed(1)
for step in range(2):
    x = torch.rand(8, 16, generator=g).half() + 0.5
    y = torch.randint(0, 4, (8,), generator=g)
    dbg.start()
    loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    dbg.stop()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dbg.step()
dbg.close()
print("LOSS", float(loss))
'''


def test_float16_overflow_is_the_trainings_own_and_names_its_first_call(tmp_path):
    with Server(str(tmp_path)) as server:
        proc = run_training(OVERFLOW, agent_config(str(tmp_path / "agent.json"), server.port))
        assert "LOSS nan" in proc.stdout, proc.stdout
        server.stop()
    rows = read_csv(server.out, "accuracy_checking_result", 0)
    assert len(rows) >= 10
    accused = [r for r in rows if "error" in (r["Forward Test Success"], r["Backward Test Success"])]
    assert not accused, accused[:3]
    precision = read_csv(server.out, "api_precision_compare_result", 0)
    assert not [r for r in precision if "error" in (r["Forward Test Success"], r["Backward Test Success"])]
    details = read_csv(server.out, "accuracy_checking_details", 0)
    assert any("in both the device and the bench" in r["Message"] for r in details)
    summary = json.load(open(glob.glob(os.path.join(server.out, "summary_*.json"))[0]))
    nonfinite = summary["nonfinite"]
    origin = nonfinite["origin"]
    assert origin["call"] == "Functional.linear.0" and origin["step"] == 0 and origin["direction"] == "forward"
    assert origin["device"] and origin["bench"]
    assert origin["module"] == "Sequential.0" and origin["source"].endswith(":15 (<module>)")   # the loss line
    assert "own overflow" in nonfinite["verdict"]
    first_input = nonfinite["by_rank"]["0"]["first_input"]
    assert first_input is not None and first_input["step"] == 0   # the inf reaches the next calls
    assert summary["first_anomaly"]["earliest"] is None
    offline = subprocess.run([sys.executable, "-m", "gpu_server.cli", "summary", server.out, "--fail-on", "error"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert offline.returncode == 0, offline.stdout + offline.stderr
    assert "inf/NaN: first inf/NaN made by Functional.linear.0 (rank 0, step 0): the training's own overflow" \
        in offline.stdout, offline.stdout
