"""The transport does not change the result (docs/design.md §5): the same seeded training, in float32 and in bfloat16,
through
plaintext gRPC, mutual TLS and the shared folder, gives the same report rows: API names, statuses and every metric
cell of the details CSVs (the timestamp in the file names aside). Real servers, real training processes."""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

from tests import support

MAKE = os.path.join(support.ROOT, "certs", "make_certs.py")
DETAILS = ("accuracy_checking_details", "api_precision_compare_details")
RESULTS = ("accuracy_checking_result", "api_precision_compare_result")

# step 0: a small MLP in float32; step 1: the same in bfloat16. Seeded, so every process computes the same values.
TRAIN = r'''
import logging, sys, torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger, seed_all
logging.basicConfig(level=logging.INFO)   # the agent's INFO lines (its counts at close)
seed_all(1234, mode=True)
dbg = PrecisionDebugger(config_path=sys.argv[1])
for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16, dtype=dtype), torch.randint(0, 8, (8,))
    dbg.start()
    loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    dbg.stop()
    opt.step()
    dbg.step()
dbg.close()
'''


def _run(tmp_path, name: str, server_kw: dict, agent_kw: dict) -> str:
    work = tmp_path / name
    work.mkdir()
    srv = support.Server(str(work), args=["--exit-when-done", "--world-size", "1"], **server_kw)
    srv.start()
    try:
        port = 0 if server_kw.get("nfs_path") else srv.port
        cfg = support.agent_config(str(work / "agent.json"), port=port, **agent_kw)
        proc = support.run_training(TRAIN, cfg)
        assert "Traceback" not in proc.stderr and "unacknowledged 0" in proc.stderr, proc.stderr[-3000:]
        assert srv.proc.wait(timeout=120) == 0, srv.log()
    finally:
        srv.kill()
    return srv.out


def _rows(out: str, kind: str) -> list[tuple]:
    rows = support.read_csv(out, kind)
    name = "API Name" if "API Name" in (rows[0] if rows else {}) else "API name"
    return sorted((r.get("Step", ""), r[name], tuple(sorted(r.items()))) for r in rows)


def test_plaintext_tls_and_folder_give_the_same_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # three servers and three trainings share the cores
    pki = tmp_path / "pki"
    subprocess.run([sys.executable, MAKE, "--out", str(pki), "--server-name", "127.0.0.1", "--client", "agent"],
                   check=True, capture_output=True)
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    setups = {
        "plaintext": ({}, {}),
        "tls": ({"tls_path": str(pki / "server")}, {"tls_path": str(pki / "clients" / "agent")}),
        "folder": ({"nfs_path": str(nfs)}, {"nfs_path": str(nfs)}),
    }
    with concurrent.futures.ThreadPoolExecutor(len(setups)) as pool:
        futures = {name: pool.submit(_run, tmp_path, name, *kw) for name, kw in setups.items()}
        outs = {name: f.result() for name, f in futures.items()}

    reference = {kind: _rows(outs["plaintext"], kind) for kind in DETAILS + RESULTS}
    details = support.read_csv(outs["plaintext"], "accuracy_checking_details")
    dtypes = {r["DEVICE Dtype"] for r in details}
    assert {"torch.float32", "torch.bfloat16"} <= dtypes, dtypes
    assert any(r["API Name"].startswith("Functional.linear.") and ".backward." in r["API Name"] for r in details) or \
        len(details) >= 8
    assert len({r["Status"] for r in details}) >= 1
    for name in ("tls", "folder"):
        for kind in DETAILS + RESULTS:
            got = _rows(outs[name], kind)
            assert got, f"{name}: no {kind} rows"
            assert got == reference[kind], f"{name} differs from plaintext in {kind}"
    assert os.listdir(nfs) == ["rank0"] and os.listdir(nfs / "rank0") == [], "the folder is drained"
