"""The shared folder with two ranks and a server restart in the middle (issue 5): a real gpu-server process watching
a real folder is killed with -9 while two training ranks write into it, then restarted with the same --out;
no record is lost and none is reported twice."""
from __future__ import annotations

import os
import time

from tests.support import Server, Training, agent_config, read_csv
from tests.test_durability import TRAIN, check_exactly_once, counts_of


def test_two_ranks_and_a_server_restart_lose_nothing_and_report_nothing_twice(tmp_path):
    work = str(tmp_path)
    nfs, out = os.path.join(work, "nfs"), os.path.join(work, "out")
    os.makedirs(nfs)
    steps = 24   # each rank waits before step 12 (its gate) until the second server is up
    first = Server(work, out=out, nfs_path=nfs).start()
    gates = {r: os.path.join(work, f"gate{r}") for r in (0, 1)}
    threads = [Training(TRAIN, agent_config(os.path.join(work, f"agent{r}.json"), nfs_path=nfs,
                                            online_close_timeout_s=120),
                        str(steps), "0.05", "1", "64", gates[r], env={"RANK": str(r), "WORLD_SIZE": "2"}, timeout=180)
               for r in (0, 1)]
    deadline = time.time() + 90
    while (min(len(read_csv(out, "accuracy_checking_result", r)) for r in (0, 1)) < 3 and time.time() < deadline
           and all(t.is_alive() for t in threads)):
        time.sleep(0.02)
    first.kill()                                   # mid-run, no drain
    assert all(t.is_alive() for t in threads), f"a training ended before the kill: {[t.error for t in threads]}"
    assert min(len(read_csv(out, "accuracy_checking_result", r)) for r in (0, 1)) >= 3, "no rows within 90 s"
    time.sleep(0.5)
    second = Server(work, out=out, nfs_path=nfs, args=["--exit-when-done", "--world-size", "2"]).start()
    for gate in gates.values():                    # steps 12-23 of both ranks go to the restarted server
        open(gate, "w").close()
    procs = [t.result(180) for t in threads]
    second.proc.wait(timeout=180)                  # exits by itself once both ranks' end markers are read
    assert second.stop() == 0
    for rank in (0, 1):
        counts = counts_of(procs[rank])
        assert counts["dropped"] == 0 and counts["unacknowledged"] == 0, counts
        per_step = check_exactly_once(out, rank, steps)
        calls = sum(len(v) for v in per_step.values())
        backward = {(r["API Name"].split(".backward.")[0], r["Step"])
                    for r in read_csv(out, "accuracy_checking_details", rank) if ".backward." in r["API Name"]}
        assert calls + len(backward) == counts["captured"], (rank, calls, len(backward), counts)
    assert not [f for r in (0, 1) for f in os.listdir(os.path.join(nfs, f"rank{r}"))], "files left in the folder"
