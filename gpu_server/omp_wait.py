"""The server's OpenMP threads sleep when they have nothing to do (docs/design.md §6.1).

torch's CPU kernels run on an OpenMP pool (GNU libgomp in the CPU wheels), whose threads by default spin for a while
after each parallel region before they sleep, waiting for the next one. A training calls large kernels back to
back; the server calls many small ones (a small record's replays, its metrics' torch ops) with Python in between,
so its idle threads spun all the time, on the cores the workers and the replay worker processes need. Measured on
this project's 2-core test machine, gpu-server --workers 1 (two torch threads) on the 2,436 small records of
bench/server.py --d 64 --layers 2 --seq 32 --batch 4 --steps 20: 17.7 s and 33 s of CPU spinning by default, 11.2 s
and 13.6 s of CPU with OMP_WAIT_POLICY=PASSIVE; on the mid transformer's 660 records the same wall time (28 s) and
39 -> 33 s of CPU. The thread count and the work each thread does are the same, so are the results.

`passive(env)` sets OMP_WAIT_POLICY=PASSIVE in `env` unless the user set it: the command line does it before torch
is loaded (libgomp reads it once, when it is loaded), and gpu_server/replay/prestart.py in each replay worker's
environment. This module imports nothing heavy.
"""
from __future__ import annotations

from typing import MutableMapping

VARIABLE = "OMP_WAIT_POLICY"


def passive(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """`env` with OMP_WAIT_POLICY=PASSIVE unless it names a policy already (the user's choice stays)."""
    env.setdefault(VARIABLE, "PASSIVE")
    return env
