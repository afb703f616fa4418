"""One real run with known failures for the report tests (tests/test_offline.py, tests/test_html_report.py): a real
gpu-server on loopback, two training subprocesses of TinyLM in bfloat16 for two steps, rank 0 with the faulty gelu
kernel of tests/faulty_kernels.py (Functional.gelu.0 and .1 fail forward, at each step: 4 failing calls), rank 1
correct. The server keeps every record (`--keep-records`) for `gpu-server recheck`. Made once per test process and
shared."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from tests import support
from tests.faulty_kernels import run_trainings

FAILING = {(0, f"Functional.gelu.{i}", step) for i in range(2) for step in range(2)}   # (rank, call, step)
STEPS = 2
_CACHE: dict[str, str] = {}


def faulty_out() -> str:
    """The --out folder of the run (made on first use)."""
    if "out" in _CACHE:
        return _CACHE["out"]
    work = tempfile.mkdtemp(prefix="report-run-")
    atexit.register(shutil.rmtree, work, True)   # the run's reports and kept records (7 MB), gone with this process
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"   # the server's same-dtype run uses the trainings' thread count
    try:
        server = support.Server(work, args=["--keep-records"]).start()   # for the recheck tests
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old
    try:
        config = support.agent_config(os.path.join(work, "agent.json"), server.port)
        common = ["--model", "tinylm", "--dtype", "bfloat16", "--steps", str(STEPS)]
        run_trainings(config, [common + ["--case", "gelu_forward"], common])
    finally:
        code = server.stop()
    assert code == 0, server.log()
    _CACHE["out"] = server.out
    return server.out
