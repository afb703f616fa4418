"""The agent against a server that is not there yet, or pauses (docs/design.md §4, §5): `block` loses nothing, `drop`
loses
only what it counts, and the count reaches the server's summary. Real server subprocesses, real gRPC."""
from __future__ import annotations

import os
import signal
import time

from tests.support import Server, Training, agent_config, free_port, read_csv
from tests.test_durability import TRAIN, check_exactly_once, counts_of, summary_of


def _train_async(cfg: str, *args: str) -> Training:
    return Training(TRAIN, cfg, *args, timeout=150)


def test_server_started_after_the_training_began_loses_nothing(tmp_path):
    work = str(tmp_path)
    port = free_port()
    cfg = agent_config(os.path.join(work, "agent.json"), port, online_max_retry_s=0.3, online_close_timeout_s=90,
                       online_memory_mb=0.05)
    steps = 6
    t = _train_async(cfg, str(steps), "0.0", "0", "32")
    time.sleep(2.5)           # the training runs (and, with a tiny budget, waits) with no server at all
    assert t.is_alive()
    with Server(work, port=port) as server:
        proc = t.result(120)
    counts = counts_of(proc)
    assert counts["captured"] == counts["acknowledged"] and counts["dropped"] == 0, counts
    per_step = check_exactly_once(server.out, 0, steps)
    assert sum(map(len, per_step.values())) == counts["captured"]
    # the agent configures no logging: its WARNING+ lines reach stderr through Python's last-resort handler
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("online check:")]
    # each state change is said once, not per record: unavailable (with why), the training waits, connected again
    kinds = ["unavailable" in w and "nothing listens there" in w for w in warnings]
    assert sum(kinds) == 1, warnings
    assert sum("the training waits" in w for w in warnings) == 1, warnings
    assert sum("connected to" in w and "again" in w for w in warnings) == 1, warnings
    assert len(warnings) == 3, warnings


def test_paused_server_under_block_loses_nothing(tmp_path):
    work = str(tmp_path)
    steps = 16
    with Server(work) as server:
        cfg = agent_config(os.path.join(work, "agent.json"), server.port, online_max_retry_s=0.3,
                           online_close_timeout_s=90, online_memory_mb=0.05)
        t = _train_async(cfg, str(steps), "0.02", "1", "32")
        deadline = time.time() + 60   # pause as soon as the agent is connected: the training is mid-run
        while "agent connected" not in server.log() and time.time() < deadline:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        server.proc.send_signal(signal.SIGCONT)
        proc = t.result(120)
    counts = counts_of(proc)
    assert counts["captured"] == counts["acknowledged"] and counts["dropped"] == 0, counts
    assert counts["loop_s"] > 2.5       # `block`: the training waited for the paused server
    check_exactly_once(server.out, 0, steps)


def test_paused_server_under_drop_loses_only_what_it_counts(tmp_path):
    work = str(tmp_path)
    steps = 30
    with Server(work) as server:
        cfg = agent_config(os.path.join(work, "agent.json"), server.port, online_max_retry_s=0.3,
                           online_close_timeout_s=90, online_memory_mb=0.05, online_policy="drop")
        server.proc.send_signal(signal.SIGSTOP)
        t = _train_async(cfg, str(steps), "0.0", "0", "32")
        time.sleep(4.0)
        server.proc.send_signal(signal.SIGCONT)
        proc = t.result(120)
    counts = counts_of(proc)
    assert counts["dropped"] > 0 and counts["unacknowledged"] == 0, counts
    assert counts["loop_s"] < 3.0, counts   # `drop`: the training did not wait for the paused server
    rows = read_csv(server.out, "accuracy_checking_result")
    assert len({(r["API name"], r["Step"]) for r in rows}) == len(rows)
    summary = summary_of(server.out)
    assert summary["records_dropped_by_agents"] == counts["dropped"]
    assert summary["ranks_ended"][0]["dropped"] == counts["dropped"]
    assert counts["captured"] - summary["records_dropped_by_agents"] == len(rows)   # forward only: a row a record
