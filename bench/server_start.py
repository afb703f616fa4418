#!/usr/bin/env python3
"""What `gpu-server` costs to start, against the floor of the same work: the command run on loopback, timed until
it listens and until its processes (the server, its fork server, its first replay worker) have settled, with their
CPU seconds; side by side with `--baseline SRC`, rounds alternating (docs/performance.md, "The server's start").

    python bench/server_start.py [--rounds 3] [--baseline SRC] [--workers 1]

The floor is one fresh interpreter doing what some process of any server start must do once: `import torch` and the
meta kernels a replay's dry run loads (gpu_server/replay/run.py warm_up), with the server's malloc thresholds and
OpenMP wait policy (gpu_server/malloc_policy.py, omp_wait.py), its CPU read before it exits. Printed per start:
seconds to "listening on", seconds until no process of the server's used CPU for 0.5 s, and the CPU seconds of the
server and of its children then, and the memory they hold together (the sum of their proportional set sizes: pages
they share counted once); last, each checkout's fastest and its CPU as a multiple of the floor's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measuring import in_turn, process_stat  # noqa: E402  (bench/measuring.py, beside this file)

SETTLED_S = 0.5
FLOOR = ("from gpu_server import malloc_policy, omp_wait\n"
         "import os\n"
         "malloc_policy.keep_freed_memory()\n"
         "omp_wait.passive(os.environ)\n"
         "import torch\n"
         "torch.mm(torch.empty(2, 2, device='meta'), torch.empty(2, 2, device='meta')).add_(1)\n"
         "torch.relu(torch.empty(2, device='meta'))\n"
         "import resource, sys\n"
         "use = resource.getrusage(resource.RUSAGE_SELF)\n"
         "print(use.ru_utime + use.ru_stime, flush=True)\n"
         "os._exit(0)\n")   # its CPU until then, as the server's is read while it runs: an exit costs 0.5-1 s more
MAIN = "import sys\nfrom gpu_server.cli import main\nsys.exit(main())\n"


def _pss_mib(pid: int) -> float:
    """The process's proportional set size (its private pages, and its share of those it shares), MiB; 0 once gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _tree(root: int) -> dict[int, float]:
    """`root` and its live descendants: their CPU seconds, each process's /proc/PID/stat read once."""
    stats = {int(name): got for name in os.listdir("/proc") if name.isdigit()
             and (got := process_stat(int(name))) is not None}
    found, todo = {root: stats[root][1]} if root in stats else {}, [root]
    while todo:
        pid = todo.pop()
        kids = [p for p, (parent, _) in stats.items() if parent == pid and p not in found]
        found.update((kid, stats[kid][1]) for kid in kids)
        todo.extend(kids)
    return found


def _tree_cpu(root: int) -> tuple[float, float]:
    """CPU seconds of `root` and of its live descendants."""
    cpu = _tree(root)
    return cpu.pop(root, 0.0), sum(cpu.values())


def _config(folder: str) -> str:
    """A loopback gpu-server config file on a free port, in `folder`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join(folder, "server.json")
    with open(path, "w") as fh:
        json.dump({"task": "run_ut", "run_ut": {"host": "127.0.0.1", "port": port, "is_online": True}}, fh)
    return path


def one_start(repo: str, workers: int) -> dict[str, float]:
    """Start the server of the checkout at `repo` once, measure it, stop it."""
    with tempfile.TemporaryDirectory() as folder:
        config = _config(folder)
        log_path = os.path.join(folder, "server.log")
        env = dict(os.environ, PYTHONPATH=repo)
        with open(log_path, "w") as log:
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-c", MAIN, "--config", config, "--out",
                                     os.path.join(folder, "out"), "--quiet", "--workers", str(workers)],
                                    cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                with open(log_path) as fh:
                    if "listening on" in fh.read():
                        break
                if proc.poll() is not None or time.perf_counter() - t0 > 120:
                    with open(log_path) as fh:
                        sys.exit(f"{repo}: the server did not start\n{fh.read()[-3000:]}")
                time.sleep(0.005)
            listening = time.perf_counter() - t0
            last, changed = -1.0, time.perf_counter()
            while time.perf_counter() - changed < SETTLED_S:
                total = sum(_tree_cpu(proc.pid))
                if total != last:
                    last, changed = total, time.perf_counter()
                time.sleep(0.01)
            own, children = _tree_cpu(proc.pid)
            memory = sum(_pss_mib(pid) for pid in _tree(proc.pid))
            return {"listening": listening, "settled": changed - t0, "server": own, "children": children,
                    "pss": memory}
        finally:
            proc.terminate()
            proc.wait(timeout=120)


def floor() -> dict[str, float]:
    """The floor, once: a fresh interpreter's torch import and meta kernels."""
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", FLOOR], check=True, cwd=ROOT, capture_output=True, text=True)
    return {"wall": time.perf_counter() - t0, "cpu": float(run.stdout.split()[-1])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="starts per checkout (default 3)")
    p.add_argument("--baseline", help="also start the server of this source tree, in alternating order")
    p.add_argument("--workers", type=int, default=1, help="the server's --workers (default 1)")
    ns = p.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("bench/server_start.py reads /proc: Linux only")
    repos = {"this": ROOT, **({"baseline": os.path.abspath(ns.baseline)} if ns.baseline else {})}
    floors = [floor() for _ in range(ns.rounds)]
    best_floor = min(floors, key=lambda f: f["cpu"])
    cpus = " ".join(f"{f['cpu']:.2f}" for f in floors)
    walls = " ".join(f"{f['wall']:.2f}" for f in floors)
    print(f"floor (a fresh interpreter: import torch, the meta kernels): CPU {cpus} s, wall {walls} s")
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in repos}
    for r in range(ns.rounds):
        for label in in_turn(list(repos), r):
            got = one_start(repos[label], ns.workers)
            runs[label].append(got)
            print(f"{label:8s} listening {got['listening']:5.2f} s, settled {got['settled']:5.2f} s, CPU: server "
                  f"{got['server']:5.2f} s, its children {got['children']:5.2f} s, together "
                  f"{got['server'] + got['children']:5.2f} s; memory (PSS) {got['pss']:4.0f} MiB", flush=True)
    for label, got in runs.items():
        cpu = min(g["server"] + g["children"] for g in got)
        print(f"{label:8s} fastest: listening {min(g['listening'] for g in got):.2f} s, settled "
              f"{min(g['settled'] for g in got):.2f} s, memory {min(g['pss'] for g in got):.0f} MiB, CPU {cpu:.2f} s "
              f"= {cpu / best_floor['cpu']:.2f}x the floor ({best_floor['cpu']:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
