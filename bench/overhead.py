"""Training-step time with the checker off, capture only, and full online checking, measured side by side.

    python bench/overhead.py [--steps 20] [--rounds 5] [--dtype bfloat16]

"capture only" runs the real capture mode (names, snapshots, backward taps and hooks) with a sink that discards
the records; "online" is the real agent streaming to a real gpu-server subprocess on loopback (the step time is
the training thread's; shipping and checking run in the background, and the time to drain at close() is printed
separately; the server runs niced on this machine's cores, where a deployment has it on another host). The
variants run round-robin in one process so that they share the machine's state; medians.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.demo import TinyLM, batches, train_step  # noqa: E402
from npu_agent import PrecisionDebugger  # noqa: E402
from npu_agent.backward import BackwardTaps  # noqa: E402
from npu_agent.capture import CaptureMode, Capturer  # noqa: E402


class _CaptureOnly:
    """The capture mode alone, as a start/stop/step facade, its records discarded."""

    def __init__(self, backward: bool = True):
        self.records = 0
        taps = BackwardTaps(self._sink) if backward else None
        self.cap = Capturer(self._sink, backward=taps)
        self.mode = CaptureMode(self.cap)

    def _sink(self, rec) -> None:
        self.records += 1

    def start(self):
        self.mode.__enter__()

    def stop(self):
        self.mode.__exit__(None, None, None)

    def step(self):
        if self.cap.backward:
            self.cap.backward.end_step()
        self.cap.next_step(self.cap.step + 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(model, opt, data, dbg) -> list[float]:
    times = []
    for idx, tgt in data:
        t0 = time.perf_counter()
        train_step(model, opt, idx, tgt, dbg)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ns = p.parse_args()
    dtype = getattr(torch, ns.dtype)
    work = tempfile.mkdtemp(prefix="bench-overhead-")
    port = _free_port()
    server_cfg, agent_cfg = os.path.join(work, "server.json"), os.path.join(work, "agent.json")
    json.dump({"task": "run_ut", "run_ut": {"host": "127.0.0.1", "port": port, "is_online": True}},
              open(server_cfg, "w"))
    json.dump({"task": "tensor", "level": "L1", "tensor": {"online_run_ut": True, "host": "127.0.0.1",
                                                             "port": port}}, open(agent_cfg, "w"))
    log = open(os.path.join(work, "server.log"), "w")
    # The server shares this machine's cores here (in a deployment it is another host): it runs at the lowest
    # priority with one thread, so that its replay of the records takes what the training leaves.
    server = subprocess.Popen([sys.executable, "-m", "gpu_server.cli", "--config", server_cfg, "--out",
                               os.path.join(work, "out"), "--quiet"], stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=lambda: os.nice(19))
    try:
        for _ in range(600):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        torch.manual_seed(0)
        model = TinyLM(dropout=0.1).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = list(batches(ns.steps))
        _steps(model, opt, data[:3], None)  # warm-up: lazy optimizer state, allocator
        online = PrecisionDebugger(config_path=agent_cfg)
        capture = _CaptureOnly()
        variants = {"off": None, "capture only": capture, "online": online}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(ns.rounds):
            for name, dbg in variants.items():
                times[name] += _steps(model, opt, data, dbg)
        t0 = time.perf_counter()
        counts = online.close()
        drain = time.perf_counter() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=600)
        log.close()
    base = statistics.median(times["off"])
    print(f"TinyLM ({ns.dtype}, 2 layers, d=32, batch 4x16), {ns.rounds} rounds x {ns.steps} steps, "
          f"torch threads {torch.get_num_threads()}")
    per_step = counts["captured"] / (ns.rounds * ns.steps)
    print(f"records per step: {per_step:.0f} (forward + backward)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:13s} median step {med * 1e3:8.2f} ms   x{med / base:6.2f} of off")
    print(f"online: {counts['captured']} records, {counts['acknowledged']} acknowledged, {counts['dropped']} dropped; "
          f"close() waited {drain:.2f} s for the server's acknowledgements")


if __name__ == "__main__":
    main()
