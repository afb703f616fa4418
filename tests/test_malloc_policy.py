"""Freed memory stays with the process (protos/malloc.py): gpu-server keeps what it frees for its next records
(gpu_server/malloc_policy.py), and the agent, once started, keeps what the training frees while its records hold
tensors (npu_agent/freed_memory.py). With the thresholds set, the same allocations made again take no new pages;
without them (where the user tuned malloc, or opted out), glibc hands them back and they fault again. Each case runs
in a fresh interpreter: the thresholds are per process."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from gpu_server import malloc_policy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what each process sets up first: gpu-server's thresholds
SERVER = r'''
from gpu_server import malloc_policy
applied = malloc_policy.keep_freed_memory()
'''
# the agent started on a shared folder (nothing captured): what a training's `debugger.start()` does
AGENT = r'''
import json, os, sys
from npu_agent import PrecisionDebugger, freed_memory
folder = sys.argv[2]   # under the test's tmp_path (pytest removes it), not left in /tmp
os.makedirs(folder, exist_ok=True)
cfg = os.path.join(folder, "agent.json")
with open(cfg, "w") as fh:
    json.dump({"task": "tensor", "level": "L1", "tensor": {"online_run_ut": True, "nfs_path": folder,
               **json.loads(sys.argv[1])}}, fh)
dbg = PrecisionDebugger(config_path=cfg)
dbg.start()
dbg.stop()
applied = freed_memory._kept[0] > 0
'''
# three rounds of 12 buffers of 10 MiB, each written as it is made (the last one held until the next round's first
# is made, as a loop variable holds it), then all freed: the page faults of the third round
ROUNDS = r'''
import resource
n = 10 << 20
for r in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = []
    for _ in range(12):
        b = bytearray(n)
        b[::4096] = b"\1" * (n // 4096)
        bufs.append(b)
    del bufs
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, faults)
'''


def _run(setup: str = SERVER, keys: str = "{}", folder: str = "", **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items()
             if k != malloc_policy.ENV and k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", setup + ROUNDS, keys, folder], capture_output=True, text=True,
                         timeout=120, check=True, env={**clean, "PYTHONPATH": ROOT, **env}).stdout.split()
    return out[-2] == "True", int(out[-1])


def test_freed_memory_is_taken_again_without_new_pages():
    applied, faults = _run()
    assert applied and faults < 1000   # 30,720 pages written, none new
    applied, faults = _run(**{malloc_policy.ENV: "0"})
    assert not applied and faults > 20_000   # glibc's own thresholds: handed back, faulted again


@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"},
                                 {"MALLOC_TRIM_THRESHOLD_": "1048576"}])
@pytest.mark.parametrize("setup", [SERVER, AGENT], ids=["server", "agent"])
def test_a_malloc_the_user_tuned_is_left_alone(env, setup, tmp_path):
    applied, faults = _run(setup, folder=str(tmp_path), **env)
    assert not applied and faults > 20_000


def test_the_agent_keeps_what_the_training_frees_unless_told_not_to(tmp_path):
    applied, faults = _run(AGENT, folder=str(tmp_path / "kept"))
    assert applied and faults < 1000   # 30,720 pages written, none new
    applied, faults = _run(AGENT, json.dumps({"online_keep_freed_memory": False}), folder=str(tmp_path / "not"))
    assert not applied and faults > 20_000


def test_the_agent_never_raises_into_the_training_when_malloc_cannot_be_set(monkeypatch):
    from npu_agent import freed_memory
    from protos import malloc

    def broken(trim_bytes: int) -> bool:
        raise OSError("no mallopt here")

    monkeypatch.setattr(freed_memory, "_kept", [0])
    monkeypatch.setattr(malloc, "keep_freed", broken)
    assert freed_memory.keep_for_held(1 << 30) is False
    assert freed_memory._kept == [0]
