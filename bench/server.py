#!/usr/bin/env python3
"""The server's checking time per training step against the training's own step time, side by side in one run.

    python bench/server.py [--steps 6] [--layers 4] [--d 512] [--seq 128] [--batch 8] [--device cpu|cuda]
                           [--keep DIR | --records DIR] [--baseline SRC] [--rounds N]

1. The training alone: a mid-size transformer (d=512, 4 layers, seq 128, batch 8, float32, SGD), pinned to one
   core, no checker: seconds per step.
2. The same training with the agent writing every forward and backward record into a shared folder (no server
   running), so that the checking below is measured alone, on exactly the records a run produces. With
   `--ranks 2` two such trainings (RANK 0 and 1) write their own records.
3. `gpu-server` in folder mode on that folder with `--workers 1` (one core), then `--workers 2` (two cores, one
   worker per rank; needs `--ranks 2`), `--exit-when-done`: from start to exit (start-up included), divided by the
   training steps recorded (all ranks).

4. The replay floor on the same records, in the same run: for each worker count, one process per worker (pinned
   to that worker's core, the ranks routed to it) decodes every record and runs exactly the replays the server runs
   for it, timed alone: the float64 (bench) run and the same-dtype run of each forward record, keeping their
   autograd graphs where the backward record will come, and of each backward record on those graphs
   (gpu_server/replay/sandbox.py `InlineReplayer` over gpu_server/replay/run.py, as the checker calls them). No
   intake, spool, metrics, spread runs or reports: what the server spends above it is its overhead.

`--keep DIR` keeps the recorded folder (and the training's step time) in DIR; `--records DIR` reuses such a folder
instead of training again. `--replay-in both` (the default) times each worker count with replays in worker
processes (the server's default) and in the server's own threads, side by side. `--baseline SRC` also times the
server code of another source tree (e.g. a `git archive` of main) on the same records, in the same run, so that
before and after are printed side by side.

Prints records/s, the server's seconds per training step for each worker count and the ratio to the training's
step time (and how many of its backward replays ran on their forward's kept graphs, from its summary.json; under it,
where its CPU went: its process by thread role and its replay workers, summary.json `cpu_s`), then the
floor's seconds and records/s (and its backward replays that ran their forward again), the ratio server / floor for
each worker count (wall; CPU in brackets), and records/s of 2 workers over 1 (the floor's own, on this machine,
beside it) last.
`--rounds N` runs the floor and each server code N times per worker count, every other round in the reverse order,
and prints the fastest of each: timed once each, the code that runs first after the floor came out 3-4 s slower on
45 s than the same code run second, which a one-order `--baseline` comparison reads as a change (use `--rounds 2` or
more there); the floor drifts as much (30.1 s in one run, 35.1 s in another, on the same records), so it takes
its turn in every round too.
`--device cuda` runs the server and the floor on the GPU (bench/gpu_check.sh).
`--second-device` records the trainings with tests/second_device.py's kernels installed: a correct device whose
matmuls, softmax, layer_norm and gelu round differently from the host's, as a real accelerator's do. The server then
analyses the device's output and the same-dtype run's apart for those calls (two passes of the metrics, no longer one
for bit-identical twins), as it does for a real device's records. Its matmuls are slow (0.3 s for a 1024x512x2048 one):
use it with `--steps 2`.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measuring import in_turn  # noqa: E402  (bench/measuring.py, beside this file)

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
if checked and os.environ.get("BENCH_SECOND_DEVICE") == "1":
    from tests import second_device   # a correct device that rounds differently (its docstring)
    second_device.install()
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
    env = dict(os.environ, PYTHONPATH=ROOT, RANK=str(rank), WORLD_SIZE=str(ns.ranks), OMP_NUM_THREADS="1",
               BENCH_SECOND_DEVICE="1" if ns.second_device else "0")
    proc = subprocess.run([sys.executable, "-c", TRAIN, cfg, str(ns.steps), str(ns.layers), str(ns.d), str(ns.seq),
                           str(ns.batch), "1" if checked else "0"], capture_output=True, text=True, env=env,
                          preexec_fn=_pin([0]), timeout=3600)
    if proc.returncode:
        sys.exit(f"training failed:\n{proc.stderr[-3000:]}")
    return _json_line(proc.stdout)


def serve(work: str, nfs: str, workers: int, ranks: int, device: str, root: str = ROOT,
          replay_in: str = "process") -> tuple[float, int, float, str, str]:
    """Seconds from the server's start to its exit once every rank's records are checked, records checked, the
    server's CPU seconds (user + system; steadier than wall time on a shared machine), how many backward replays
    ran on their forward's kept graphs (summary.json `memory`; "" from a server that does not count them), and
    where its CPU went (`cpu_line`; "" from a server that does not say)."""
    out = tempfile.mkdtemp(prefix="out-", dir=work)
    cfg = os.path.join(work, f"server{workers}.json")
    with open(cfg, "w") as fh:
        json.dump({"task": "run_ut", "run_ut": {"white_list": [], "black_list": [], "error_data_path": "",
                                                "is_online": True, "nfs_path": nfs, "host": "127.0.0.1", "port": 0,
                                                "rank_list": [], "tls_path": ""}}, fh)
    exe = os.path.join(os.path.dirname(sys.executable), "gpu-server")
    # an interpreter the project is not installed into (PYTHON=python3 bash bench/gpu_check.sh): the same CLI as a
    # module, from `root` (PYTHONPATH below)
    launcher = [exe] if os.path.exists(exe) else [sys.executable, "-m", "gpu_server.cli"]
    cmd = [*launcher, "--config", cfg, "--out", out, "--quiet", "--exit-when-done", "--world-size", str(ranks),
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
    memory = summary.get("memory", {})
    kept, again = memory.get("backward_replays_on_kept_graphs"), memory.get("backward_replays_forward_again")
    graphs = f"; backward replays on kept graphs: {kept} of {kept + again}" if kept is not None and again is not None \
        else ""
    return seconds, sum(summary["records_received"].values()), cpu, graphs, cpu_line(summary.get("cpu_s"))


def cpu_line(cpu: dict | None) -> str:
    """summary.json `cpu_s` (gpu_server/reports/cpu_use.py) as one line: the server process's CPU by thread role,
    busiest first (roles under 0.1 s with the rest), and its replay workers'."""
    if not cpu:
        return ""
    shown = {name: s for name, s in cpu["threads"].items() if s >= 0.1}
    rest = cpu["rest"] + sum(s for name, s in cpu["threads"].items() if name not in shown)
    parts = ", ".join(f"{name} {s:.1f}" for name, s in shown.items())
    return (f"its CPU: the server process {cpu['process']:.1f} s ({parts}{', ' if parts else ''}the rest {rest:.1f}), "
            f"its replay workers {cpu['replay_workers']:.1f} s")


def _folder_records(nfs: str, rank: int):
    """(record, payload) of every record file of `rank` in the recorded folder, in sequence order, read the way the
    folder intake reads them (protos/folder_format.py: the magic, then length-prefixed frames; one record, its
    chunks, or one Batch frame)."""
    from gpu_server.intake.assembler import FrameAssembler
    from protos.folder_format import FOLDER_MAGIC, FRAME_LENGTH, RECORD_FILE
    from protos.framing import parse_frame, split_batch
    from protos.limits import DEFAULT_LIMITS

    folder = os.path.join(nfs, f"rank{rank}")
    names = sorted((int(m.group(3)), m.group(0)) for m in map(RECORD_FILE.match, os.listdir(folder)) if m)
    for _, name in names:
        with open(os.path.join(folder, name), "rb") as fh:
            raw = fh.read()
        assert raw.startswith(FOLDER_MAGIC), name
        pos, asm = len(FOLDER_MAGIC), FrameAssembler()
        while pos < len(raw):
            (n,) = FRAME_LENGTH.unpack_from(raw, pos)
            frame, data = parse_frame(raw[pos + FRAME_LENGTH.size:pos + FRAME_LENGTH.size + n])
            pos += FRAME_LENGTH.size + n
            if frame.WhichOneof("body") == "batch":
                yield from split_batch(frame, DEFAULT_LIMITS, data)
            else:
                done = asm.feed(frame, data)
                if done is not None:
                    yield done


def replay_floor(nfs: str, ranks: list[int], workers: int, device_name: str = "cpu") -> dict:
    """`_replay_floor`, leaving this thread's grad mode and torch's thread count as they were (a test calls it in
    its own process)."""
    import torch

    grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
    try:
        return _replay_floor(nfs, ranks, workers, device_name)
    finally:
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)


def _replay_floor(nfs: str, ranks: list[int], workers: int, device_name: str = "cpu") -> dict:
    """The replay floor of one server worker, in this process: every record of `ranks` decoded
    (gpu_server/decode.py), then exactly the replays the server runs for it, timed alone: the bench run and the
    same-dtype run of each forward record (with their autograd graphs kept when its backward record will come, as
    gpu_server/checking/pending.py asks), and of each backward record on the graphs its forward kept
    (gpu_server/replay/sandbox.py `InlineReplayer`, the functions of gpu_server/replay/run.py the checker's replays
    run; a call whose graphs were not kept is replayed in full, as the checker does). Nothing else: no intake, spool,
    metrics, spread runs or reports. Records the server does not replay (a SKIP reason, a collective, a record the
    intake finds not replayable) are decoded and left out, as the server leaves them out."""
    import torch

    from gpu_server.decode import decode_job
    from gpu_server.job import call_key
    from gpu_server.replay import run as replay
    from gpu_server.replay.registry import replayable
    from gpu_server.replay.run import ReplayError, flatten_outputs
    from gpu_server.replay.sandbox import InlineReplayer
    from protos import online_check_pb2 as pb

    device = torch.device(device_name)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)   # a GPU's time is its kernels'
    torch.set_grad_enabled(False)            # as the server's worker threads
    replay.warm_up()                         # as the server, before its first record
    match = workers == 1                     # several CPU workers: no per-call thread count (checking/workers.py)
    if workers > 1:
        torch.set_num_threads(max(1, replay.usable_cores()))   # this process is one worker's share of the cores
    replayer = InlineReplayer(device)
    graph_budget = 2 << 30                   # gpu-server --graph-memory-mb's default, per worker
    waiting: dict = {}                       # call -> (forward job, kept graphs, their bytes), oldest first
    held = 0
    seconds = cpu = decode = 0.0
    records = replayed = full = 0

    def timed(fn, *args):
        nonlocal seconds, cpu
        sync()
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args)
        except ReplayError:
            return None
        finally:
            sync()
            seconds += time.perf_counter() - w0
            cpu += time.process_time() - c0

    for rank in ranks:
        for record, payload in _folder_records(nfs, rank):
            records += 1
            d0 = time.perf_counter()
            job = decode_job(record, payload)
            decode += time.perf_counter() - d0
            if job.collective is not None:
                continue
            if not job.skip_reason:
                job.skip_reason = replayable(job.category, job.api, job.args, job.kwargs) or ""
            if job.direction == pb.FORWARD:
                runs = None
                if not job.skip_reason:
                    replayed += 1
                    runs = timed(replayer.forward, job, job.backward_expected, match)
                if job.backward_expected:
                    old = waiting.pop(call_key(job), None)
                    held -= old[2] if old else 0
                    kept = runs.kept if runs is not None else None
                    waiting[call_key(job)] = (job, kept, runs.nbytes if kept is not None else 0)
                    held += waiting[call_key(job)][2]
                    while held > graph_budget:   # the oldest kept graphs go first (pending.py `_evict_graphs`)
                        key = next(k for k, v in waiting.items() if v[1] is not None)
                        fwd, _, nbytes = waiting[key]
                        waiting[key] = (fwd, None, 0)
                        held -= nbytes
                continue
            fwd, kept, nbytes = waiting.pop(call_key(job), (None, None, 0))
            held -= nbytes
            if (job.skip_reason or fwd is None or fwd.skip_reason or job.grad_input is None
                    or not flatten_outputs(job.grad_input)):
                continue
            replayed += 1
            full += kept is None
            timed(replayer.backward, fwd, job, kept, match)
    return {"seconds": seconds, "cpu": cpu, "records": records, "replayed": replayed, "decode": decode,
            "full_backward": full}


def floor(keep: str, workers: int, ranks: int, device: str) -> dict:
    """The replay floor for `workers` workers: one process per worker, pinned to the core that worker's server gets,
    each replaying the records of the ranks routed to it (rank % workers), side by side. Seconds: the slowest one's
    replay time (the worker that finishes last); CPU: all of theirs."""
    procs = []
    for i in range(workers):
        mine = ",".join(str(r) for r in range(ranks) if r % workers == i)
        cmd = [sys.executable, os.path.abspath(__file__), "--floor-of", keep, "--floor-ranks", mine,
               "--floor-workers", str(workers), "--device", device]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ, PYTHONPATH=ROOT), preexec_fn=_pin([1 + i])))
    parts = []
    for proc in procs:
        out, err = proc.communicate(timeout=7200)
        if proc.returncode:
            sys.exit(f"the replay floor failed:\n{err[-3000:]}")
        parts.append(_json_line(out))
    return {"seconds": max(p["seconds"] for p in parts), "cpu": sum(p["cpu"] for p in parts),
            "records": sum(p["records"] for p in parts), "replayed": sum(p["replayed"] for p in parts),
            "decode": max(p["decode"] for p in parts), "full_backward": sum(p["full_backward"] for p in parts)}


def turns(codes: list, r: int) -> list:
    """Round r's order: the floor (None) and then each server code, every other round the reverse. On this machine
    the code timed first after the floor ran 3-4 s slower on 45 s than the same code timed second, so one order alone
    favours the second; and the floor itself drifts between rounds as the server does (30.1-35.1 s for the same
    records on one day), so it takes its turn in every round rather than once before them."""
    return list(in_turn([None, *codes], r))


def fastest_floor(runs: list[dict]) -> dict:
    """The floor of several rounds: the fastest seconds and the least CPU (other work only adds), the counts of the
    first (the same records every round)."""
    return dict(runs[0], seconds=min(f["seconds"] for f in runs), cpu=min(f["cpu"] for f in runs),
                decode=min(f["decode"] for f in runs))


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
    p.add_argument("--second-device", action="store_true",
                   help="record with tests/second_device.py's kernels: a correct device that rounds differently")
    p.add_argument("--records", help="time the server on a folder kept with --keep instead of training again")
    p.add_argument("--baseline", help="also time the server code of this source tree on the same records")
    p.add_argument("--rounds", type=int, default=1, help="times the floor and each server code run per worker "
                   "count, every other round in the reverse order; the fastest is printed (2 or more with --baseline)")
    p.add_argument("--replay-in", choices=("both", "process", "thread"), default="both",
                   help="time replays in worker processes, in the server's threads, or both side by side (default)")
    p.add_argument("--floor-of", help=argparse.SUPPRESS)          # internal: one worker's replay floor (`floor`)
    p.add_argument("--floor-ranks", help=argparse.SUPPRESS)
    p.add_argument("--floor-workers", type=int, default=1, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.floor_of:
        ranks = [int(r) for r in ns.floor_ranks.split(",") if r]
        print("BENCH " + json.dumps(replay_floor(ns.floor_of, ranks, ns.floor_workers, ns.device)))
        return
    work = tempfile.mkdtemp(prefix="bench-server-")
    try:
        nfs = os.path.join(work, "nfs")
        if ns.records:
            with open(os.path.join(ns.records, "bench.json"), encoding="utf-8") as fh:
                meta = json.load(fh)
            plain, recorded = meta["plain"], meta["recorded"]
            ns.steps, ns.ranks = meta["steps"], meta["ranks"]
            ns.second_device = meta.get("second_device", False)
            keep = os.path.join(ns.records, "nfs")
        else:
            plain = train(work, ns, checked=False)
            recorded = [train(work, ns, checked=True, rank=r) for r in range(ns.ranks)]
            keep = os.path.join(ns.keep or work, "nfs" if ns.keep else "nfs-recorded")
            if ns.keep:
                os.makedirs(ns.keep, exist_ok=True)
                shutil.rmtree(keep, ignore_errors=True)
                with open(os.path.join(ns.keep, "bench.json"), "w", encoding="utf-8") as fh:
                    json.dump({"plain": plain, "recorded": recorded, "steps": ns.steps, "ranks": ns.ranks,
                               "second_device": ns.second_device}, fh)
            shutil.copytree(nfs, keep, copy_function=_link_or_copy)
        rows, floors = [], {}
        modes = ("process", "thread") if ns.replay_in == "both" else (ns.replay_in,)
        codes = [(f" --replay-in {m}", ROOT, m) for m in modes] + (
            [(" (baseline)", os.path.abspath(ns.baseline), "")] if ns.baseline else [])
        for workers in (1, 2) if ns.ranks >= 2 else (1,):
            runs: dict[str, list[tuple[float, int, float, str]]] = {label: [] for label, _, _ in codes}
            floor_runs = []
            for r in range(ns.rounds):
                for code in turns(codes, r):
                    if code is None:
                        floor_runs.append(floor(keep, workers, ns.ranks, ns.device))
                        continue
                    label, root, mode = code
                    shutil.rmtree(nfs, ignore_errors=True)
                    shutil.copytree(keep, nfs, copy_function=_link_or_copy)   # the server consumes its folder
                    runs[label].append(serve(work, nfs, workers, ns.ranks, ns.device, root, mode))
            floors[workers] = fastest_floor(floor_runs)
            for label, got in runs.items():   # the fastest round of each (wall and CPU apart): other work only adds
                fastest = min(got, key=lambda g: g[0])
                rows.append((f"{workers}{label}", fastest[0], got[0][1], min(g[2] for g in got), got[0][3],
                             fastest[4]))
        base = plain["cpu_per_step"]
        print(f"training alone (1 core): {base * 1e3:.0f} ms CPU/step ({plain['wall_per_step'] * 1e3:.0f} ms wall); "
              f"with the agent writing to a folder: {recorded[0]['cpu_per_step'] * 1e3:.0f} ms CPU/step; "
              f"{recorded[0]['captured']} records per rank ({ns.steps + 1} steps, {ns.ranks} ranks)")
        if ns.second_device:
            print("recorded on the second device (tests/second_device.py: matmuls, softmax, layer_norm and gelu "
                  "round differently), whose outputs differ from the server's same-dtype run as a real device's do; "
                  "the training's times above are its own")
        if ns.rounds > 1:
            print(f"the floor and each server code ran {ns.rounds} times per worker count, in alternating order: the "
                  "fastest below")
        for workers, seconds, records, cpu, graphs, split in rows:
            per_step = seconds / (ns.steps + 1) / ns.ranks
            cores = workers.split()[0]
            print(f"server --workers {workers} on {ns.device} ({cores} core(s)): {records} records in "
                  f"{seconds:.1f} s = {records / seconds:.0f} records/s; {per_step:.2f} s per training step "
                  f"= {per_step / base:.1f}x the training's step; server CPU {cpu:.1f} s = "
                  f"{cpu / (ns.steps + 1) / ns.ranks / base:.1f}x the training's CPU per step{graphs}")
            if split:   # the fastest round's
                print(f"  {split}")
        print("ratio (server time per training step / training CPU per step): "
              + ", ".join(f"workers={w}: {s / (ns.steps + 1) / ns.ranks / base:.1f}x (CPU "
                          f"{c / (ns.steps + 1) / ns.ranks / base:.1f}x)" for w, s, _, c, *_ in rows))
        for workers, f in floors.items():
            print(f"replay floor, {workers} worker(s) ({workers} process(es), one core each, side by side): "
                  f"{f['replayed']} of {f['records']} records replayed (bench + same-dtype, forward and backward) in "
                  f"{f['seconds']:.1f} s = {f['records'] / f['seconds']:.0f} records/s; CPU {f['cpu']:.1f} s "
                  f"(decoding, not counted: {f['decode']:.1f} s); backward replays that ran their forward again: "
                  f"{f['full_backward']}")
        print("ratio (server time / its replay floor): " + ", ".join(
            f"workers={w}: {s / floors[int(w.split()[0])]['seconds']:.2f}x (CPU "
            f"{c / floors[int(w.split()[0])]['cpu']:.2f}x)" for w, s, _, c, *_ in rows))
        if len(floors) == 2:
            by = {w: r / s for w, s, r, *_ in rows}
            print("records/s, 2 workers / 1 worker: " + ", ".join(
                f"{w[1:].strip() or 'this tree'}: {by['2' + w[1:]] / by[w]:.2f}x" for w in by if w.startswith("1"))
                  + f"; replay floor: {floors[1]['seconds'] / floors[2]['seconds']:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
