"""gpu-server keeps the memory it frees for its next records (gpu_server/malloc_policy.py): with the policy, the
same allocations made again take no new pages; without it (or where the user tuned malloc, or opted out), glibc
hands them back and they fault again. Each case runs in a fresh interpreter: the thresholds are per process."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from gpu_server import malloc_policy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# three rounds of 12 buffers of 10 MiB, each written as it is made (the last one held until the next round's first
# is made, as a loop variable holds it), then all freed: the page faults of the third round
ROUNDS = r'''
import resource, sys
from gpu_server import malloc_policy
applied = malloc_policy.keep_freed_memory()
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


def _run(**env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items()
             if k != malloc_policy.ENV and k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", ROUNDS], capture_output=True, text=True, timeout=120, check=True,
                         env={**clean, "PYTHONPATH": ROOT, **env}).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_memory_is_taken_again_without_new_pages():
    applied, faults = _run()
    assert applied and faults < 1000   # 30,720 pages written, none new
    applied, faults = _run(**{malloc_policy.ENV: "0"})
    assert not applied and faults > 20_000   # glibc's own thresholds: handed back, faulted again


@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"},
                                 {"MALLOC_TRIM_THRESHOLD_": "1048576"}])
def test_a_malloc_the_user_tuned_is_left_alone(env):
    applied, faults = _run(**env)
    assert not applied and faults > 20_000
