"""Large records (docs/design.md §5): one 256 MiB tensor, far larger than one gRPC message, travels in 4 MiB chunks, is
spooled,
checked and reported; memory stays bounded on both sides. 256 MiB is the largest this suite affords on the 2-core
test machine within its time budget (about 10 s for this test); the server accepts up to --max-record-mb (by default
half of --memory-mb). Real server subprocess, real gRPC, a real training subprocess."""
from __future__ import annotations

import json
import os

from tests.support import Server, agent_config, memory_of, read_csv, run_training

MiB = 1 << 20
ELEMENTS = 64 * MiB        # float32: 256 MiB

LARGE = r'''
import json, resource, sys, torch
from npu_agent import PrecisionDebugger
n = int(sys.argv[2])
dbg = PrecisionDebugger(config_path=sys.argv[1])
x = torch.rand(n)
dbg.start()
total = torch.sum(x)
dbg.stop()
counts = dbg.close()
print("COUNTS " + json.dumps(dict(counts, maxrss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))
'''


def _peak_rss(pid: int) -> int:
    return memory_of(pid, "VmHWM")


def test_a_256_mib_record_round_trips_and_is_checked(tmp_path):
    work = str(tmp_path)
    # A record is held at its estimated peak while it is checked (docs/security.md, "Memory"): a 256 MiB float32
    # input is estimated at about 2.8 GiB, so 3072 MiB hold it; the largest record is half the budget by default.
    with Server(work, args=("--memory-mb", "3072")) as server:
        cfg = agent_config(os.path.join(work, "agent.json"), server.port)
        proc = run_training(LARGE, cfg, str(ELEMENTS), timeout=120)
        server_peak = _peak_rss(server.proc.pid)
    counts = json.loads([x for x in proc.stdout.splitlines() if x.startswith("COUNTS ")][-1][7:])
    assert counts["captured"] == counts["acknowledged"] == 1, counts
    details = read_csv(server.out, "accuracy_checking_details")
    assert [(r["API Name"], r["Status"]) for r in details] == [("Torch.sum.0.forward.output.0", "pass")], details
    result = read_csv(server.out, "accuracy_checking_result")
    assert [(r["API name"], r["Forward Test Success"]) for r in result] == [("Torch.sum.0", "pass")]
    with open([os.path.join(server.out, f) for f in os.listdir(server.out) if f.startswith("summary_")][0]) as fh:
        summary = json.load(fh)
    assert summary["memory"]["payload_peak_bytes"] >= ELEMENTS * 4
    # Bounded: the payload once, its float64 upcast for the bench run, plus torch itself; the agent holds the
    # tensor, its snapshot and a few 4 MiB frames, never the whole record serialized.
    payload = ELEMENTS * 4
    assert server_peak < 4 * payload + 700 * MiB, server_peak / MiB
    assert counts["maxrss_kb"] * 1024 < 3 * payload + 700 * MiB, counts["maxrss_kb"] / 1024
    print(f"\n256 MiB record: server peak RSS {server_peak / MiB:.0f} MiB, agent peak RSS "
          f"{counts['maxrss_kb'] / 1024:.0f} MiB")
