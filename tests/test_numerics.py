"""The checker does not change the training's numerics (issues 2, 3): parameters after 3 steps are bitwise identical
with the checker on and off, with dropout and with both kinds of activation checkpointing; and with
`online_run_ut_recompute` no backward records are captured at all."""
import json

import pytest

from tests.support import Server, agent_config, read_csv, run_training

SAME_PARAMS = r"""
import json, sys, torch, torch.nn as nn, torch.nn.functional as F, torch.utils.checkpoint as ckpt
from examples.demo import TinyLM, batches
from npu_agent import PrecisionDebugger

class CkptLM(TinyLM):
    def __init__(self, reentrant):
        super().__init__(dropout=0.1)
        self.reentrant = reentrant
    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = ckpt.checkpoint(block, x, use_reentrant=self.reentrant) if self.reentrant is not None else block(x)
        logits = F.linear(self.ln(x), self.tok.weight)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

def run(dbg, reentrant, dtype):
    torch.manual_seed(0)
    model = CkptLM(reentrant).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for idx, tgt in batches(3):
        if dbg: dbg.start()
        loss = model(idx, tgt)
        loss.backward()
        if dbg: dbg.stop()
        opt.step(); opt.zero_grad()
        if dbg: dbg.step()
    return [p.detach().clone() for p in model.parameters()]

dbg = PrecisionDebugger(config_path=sys.argv[1])
mode = sys.argv[2]
reentrant = {"plain": None, "reentrant": True, "nonreentrant": False}[mode]
dtypes = (torch.float32, torch.bfloat16) if mode == "plain" else (torch.bfloat16,)
for dtype in dtypes:
    off = run(None, reentrant, dtype)
    on = run(dbg, reentrant, dtype)
    same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a, b.view(torch.uint8)
               if b.dtype == torch.bfloat16 else b) for a, b in zip(off, on))
    assert same, f"parameters differ with the checker on ({mode}, {dtype})"
counts = dbg.close()
assert counts["unacknowledged"] == 0, counts
print("COUNTS " + json.dumps(dict(counts, runs=len(dtypes))))
print("IDENTICAL", mode)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("numerics"))
    with Server(work) as srv:
        yield srv


@pytest.mark.parametrize("mode", ["plain", "reentrant", "nonreentrant"])
def test_parameters_bitwise_identical_with_checker_on_and_off(server, tmp_path, mode):
    cfg = agent_config(str(tmp_path / "agent.json"), server.port)
    proc = run_training(SAME_PARAMS, cfg, mode)
    assert f"IDENTICAL {mode}" in proc.stdout
    # the comparison means something only if the checker was on: calls were captured and sent in the runs with
    # it (3 steps of TinyLM per dtype, forward and backward records), every one acknowledged
    line = [x for x in proc.stdout.splitlines() if x.startswith("COUNTS ")][-1]
    counts = json.loads(line[len("COUNTS "):])
    assert counts["forward_calls"] >= 3 * 10 * counts["runs"], counts
    assert counts["captured"] >= counts["forward_calls"] and counts["sent"] == counts["captured"], counts
    assert counts["acknowledged"] + counts["rejected"] == counts["captured"], counts


def test_recompute_flag_captures_no_backward(server, tmp_path):
    cfg = agent_config(str(tmp_path / "agent.json"), server.port, online_run_ut_recompute=True)
    run_training(SAME_PARAMS, cfg, "reentrant", env={"RANK": "5"})
    server.stop()
    rows = read_csv(server.out, "accuracy_checking_result", rank=5)
    assert rows and all(r["Backward Test Success"] == " " for r in rows)
    details = read_csv(server.out, "accuracy_checking_details", rank=5)
    assert not [r for r in details if ".backward." in r["API Name"]]
    names = [(r["Step"], r["API name"]) for r in rows]
    assert len(names) == len(set(names))
