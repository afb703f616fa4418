"""A forward record that goes out skipped, whose backward record follows, is one call: one result row (docs/design.md
§4: a tensor changed by code the mode did not see is never sent with the changed value; gpu_server/checking/pending.py:
a
call's lifecycle). The training changes an input in place after stop(), outside the mode's view, while its records
wait for a server that is not up yet."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import support

TRAIN = r'''
import json, sys, time, torch, torch.nn.functional as F
from npu_agent import PrecisionDebugger
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(8, 16))
x = torch.randn(4, 16)
dbg = PrecisionDebugger(config_path=sys.argv[1])
dbg.start()
torch.ones(3) * 2   # the sender takes this record, then waits for a server with it: the next ones queue up
time.sleep(1.0)
h = F.linear(x, w)
loss = torch.relu(h).sum()
loss.backward()
dbg.stop()
x.mul_(0)        # unseen by the mode; x is not a parameter, so stop() did not copy it
print("CHANGED", flush=True)
print("COUNTS " + json.dumps(dbg.close()), flush=True)
'''


def test_skipped_forward_and_its_backward_make_one_row(tmp_path):
    port = support.free_port()
    agent = support.agent_config(str(tmp_path / "agent.json"), port=port, online_connect_timeout_s=120,
                                 online_max_retry_s=0.5)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, str(script), agent], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("CHANGED"):
                break
        with support.Server(str(tmp_path), port=port) as server:
            out, _ = proc.communicate(timeout=180)
        lines.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines)
    counts = json.loads(next(x for x in text.splitlines() if x.startswith("COUNTS "))[len("COUNTS "):])
    assert counts["acknowledged"] == counts["captured"], text
    rows = support.read_csv(server.out, "accuracy_checking_result")
    names = [r["API name"] for r in rows]
    assert names.count("Functional.linear.0") == 1, rows
    linear = support.by_name(rows)["Functional.linear.0"]
    assert linear["Forward Test Success"] == "SKIP" and "changed in place" in linear["Message"], linear
