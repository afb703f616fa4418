#!/usr/bin/env python3
"""The server's checking time per training step against the training's own step time, side by side in one run.

    python bench/server.py [--steps 6] [--layers 4] [--d 512] [--seq 128] [--batch 8] [--device cpu|cuda]
                           [--keep DIR | --records DIR] [--baseline SRC]

1. The training alone: a mid-size transformer (d=512, 4 layers, seq 128, batch 8, float32, SGD), pinned to one
   core, no checker: seconds per step.
2. The same training with the agent writing every forward and backward record into a shared folder (no server
   running), so that the checking below is measured alone, on exactly the records a run produces. With
   `--ranks 2` two such trainings (RANK 0 and 1) write their own records.
3. `gpu-server` in folder mode on that folder with `--workers 1` (one core), then `--workers 2` (two cores, one
   worker per rank; needs `--ranks 2`), `--exit-when-done`: from start to exit (start-up included), divided by the
   training steps recorded (all ranks).

`--keep DIR` keeps the recorded folder (and the training's step time) in DIR; `--records DIR` reuses such a folder
instead of training again. `--replay-in both` (the default) times each worker count with replays in worker
processes (the server's default) and in the server's own threads, side by side. `--baseline SRC` also times the
server code of another source tree (e.g. a `git archive` of main) on the same records, in the same run, so that
before and after are printed side by side.

Prints records/s, the server's seconds per training step for each worker count, and the ratio to the training's
step time last. `--device cuda` runs the server on the GPU (bench/gpu_check.sh).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gpu_server.reports import files as report_files  # noqa: E402

TRAIN = r'''
import json, os, sys, time, torch, torch.nn as nn, torch.nn.functional as F
cfg, steps, layers, d, seq, batch, checked = sys.argv[1], *map(int, sys.argv[2:7]), sys.argv[7] == "1"
torch.manual_seed(0)
layer = lambda: nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, dropout=0.0, batch_first=True)
model = nn.Sequential(*[layer() for _ in range(layers)], nn.Linear(d, 256))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(batch, seq, d), torch.randint(0, 256, (batch, seq))
dbg = None
if checked:
    from npu_agent import PrecisionDebugger
    dbg = PrecisionDebugger(config_path=cfg)
def one():
    if dbg: dbg.start()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    if dbg: dbg.stop()
    opt.step(); opt.zero_grad()
    if dbg: dbg.step()
one()  # warm-up (not captured by the timing; captured records are checked like the rest)
t0 = time.process_time(); w0 = time.perf_counter()
for _ in range(steps):
    one()
cpu, wall = time.process_time() - t0, time.perf_counter() - w0
counts = dbg.close() if dbg else {}
print("BENCH " + json.dumps({"cpu_per_step": cpu / steps, "wall_per_step": wall / steps,
                             "captured": counts.get("captured", 0)}))
'''


def _pin(cores: list[int]):
    usable = sorted(os.sched_getaffinity(0))
    chosen = [usable[c % len(usable)] for c in cores]
    return lambda: os.sched_setaffinity(0, chosen)


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the file system allows one (no second copy of gigabytes of records), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _json_line(stdout: str) -> dict:
    return json.loads([x for x in stdout.splitlines() if x.startswith("BENCH ")][-1][6:])


def train(work: str, ns, checked: bool, rank: int = 0) -> dict:
    cfg = os.path.join(work, "agent.json")
    os.makedirs(os.path.join(work, "nfs"), exist_ok=True)
    with open(cfg, "w") as fh:
        json.dump({"task": "tensor", "dump_path": os.path.join(work, "dump"), "level": "L1", "rank": [], "step": [],
                   "tensor": {"scope": [], "list": [], "online_run_ut": True, "nfs_path": os.path.join(work, "nfs"),
                              "host": "127.0.0.1", "port": 1, "tls_path": "", "online_run_ut_recompute": False}}, fh)
    env = dict(os.environ, PYTHONPATH=ROOT, RANK=str(rank), WORLD_SIZE=str(ns.ranks), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", TRAIN, cfg, str(ns.steps), str(ns.layers), str(ns.d), str(ns.seq),
                           str(ns.batch), "1" if checked else "0"], capture_output=True, text=True, env=env,
                          preexec_fn=_pin([0]), timeout=3600)
    if proc.returncode:
        sys.exit(f"training failed:\n{proc.stderr[-3000:]}")
    return _json_line(proc.stdout)


def serve(work: str, nfs: str, workers: int, ranks: int, device: str, root: str = ROOT,
          replay_in: str = "process") -> tuple[float, int, float]:
    """Seconds from the server's start to its exit once every rank's records are checked, records checked, and the
    server's CPU seconds (user + system; steadier than wall time on a shared machine)."""
    out = tempfile.mkdtemp(prefix="out-", dir=work)
    cfg = os.path.join(work, f"server{workers}.json")
    with open(cfg, "w") as fh:
        json.dump({"task": "run_ut", "run_ut": {"white_list": [], "black_list": [], "error_data_path": "",
                                                "is_online": True, "nfs_path": nfs, "host": "127.0.0.1", "port": 0,
                                                "rank_list": [], "tls_path": ""}}, fh)
    exe = os.path.join(os.path.dirname(sys.executable), "gpu-server")
    cmd = [exe, "--config", cfg, "--out", out, "--quiet", "--exit-when-done", "--world-size", str(ranks),
           "--device", device, "--workers", str(workers)] + (["--replay-in", replay_in] if replay_in else [])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=_pin(list(range(1, 1 + workers))),
                          env=dict(os.environ, PYTHONPATH=root), timeout=7200)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode:
        sys.exit(f"gpu-server failed:\n{proc.stderr[-3000:]}")
    with open(glob.glob(report_files.summary_path(glob.escape(out), "*"))[0], encoding="utf-8") as fh:
        summary = json.load(fh)
    return seconds, sum(summary["records_received"].values()), cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2, help="training processes writing records (2 for --workers 2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--keep", help="keep the recorded folder and the training's step time in this folder")
    p.add_argument("--records", help="time the server on a folder kept with --keep instead of training again")
    p.add_argument("--baseline", help="also time the server code of this source tree on the same records")
    p.add_argument("--replay-in", choices=("both", "process", "thread"), default="both",
                   help="time replays in worker processes, in the server's threads, or both side by side (default)")
    ns = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-server-")
    try:
        nfs = os.path.join(work, "nfs")
        if ns.records:
            with open(os.path.join(ns.records, "bench.json"), encoding="utf-8") as fh:
                meta = json.load(fh)
            plain, recorded = meta["plain"], meta["recorded"]
            ns.steps, ns.ranks = meta["steps"], meta["ranks"]
            keep = os.path.join(ns.records, "nfs")
        else:
            plain = train(work, ns, checked=False)
            recorded = [train(work, ns, checked=True, rank=r) for r in range(ns.ranks)]
            keep = os.path.join(ns.keep or work, "nfs" if ns.keep else "nfs-recorded")
            if ns.keep:
                os.makedirs(ns.keep, exist_ok=True)
                shutil.rmtree(keep, ignore_errors=True)
                with open(os.path.join(ns.keep, "bench.json"), "w", encoding="utf-8") as fh:
                    json.dump({"plain": plain, "recorded": recorded, "steps": ns.steps, "ranks": ns.ranks}, fh)
            shutil.copytree(nfs, keep, copy_function=_link_or_copy)
        rows = []
        modes = ("process", "thread") if ns.replay_in == "both" else (ns.replay_in,)
        codes = [(f" --replay-in {m}", ROOT, m) for m in modes] + (
            [(" (baseline)", os.path.abspath(ns.baseline), "")] if ns.baseline else [])
        for workers in (1, 2) if ns.ranks >= 2 else (1,):
            for label, root, mode in codes:
                shutil.rmtree(nfs, ignore_errors=True)
                shutil.copytree(keep, nfs, copy_function=_link_or_copy)   # the server consumes its folder
                seconds, records, cpu = serve(work, nfs, workers, ns.ranks, ns.device, root, mode)
                rows.append((f"{workers}{label}", seconds, records, cpu))
        base = plain["cpu_per_step"]
        print(f"training alone (1 core): {base * 1e3:.0f} ms CPU/step ({plain['wall_per_step'] * 1e3:.0f} ms wall); "
              f"with the agent writing to a folder: {recorded[0]['cpu_per_step'] * 1e3:.0f} ms CPU/step; "
              f"{recorded[0]['captured']} records per rank ({ns.steps + 1} steps, {ns.ranks} ranks)")
        for workers, seconds, records, cpu in rows:
            per_step = seconds / (ns.steps + 1) / ns.ranks
            cores = workers.split()[0]
            print(f"server --workers {workers} on {ns.device} ({cores} core(s)): {records} records in "
                  f"{seconds:.1f} s = {records / seconds:.0f} records/s; {per_step:.2f} s per training step "
                  f"= {per_step / base:.1f}x the training's step; server CPU {cpu:.1f} s = "
                  f"{cpu / (ns.steps + 1) / ns.ranks / base:.1f}x the training's CPU per step")
        print("ratio (server time per training step / training CPU per step): "
              + ", ".join(f"workers={w}: {s / (ns.steps + 1) / ns.ranks / base:.1f}x (CPU "
                          f"{c / (ns.steps + 1) / ns.ranks / base:.1f}x)" for w, s, _, c in rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
