"""bench/server.py's replay floor (issue 25): it reads a recorded folder the way the folder intake does and runs the
replays the server runs for each record, and only those (a record with a SKIP reason is decoded, not replayed)."""
from __future__ import annotations

import importlib.util
import os

import torch

from npu_agent.records import PendingRecord
from npu_agent.sender import Sender
from npu_agent.snapshot import snapshot
from npu_agent.transport_folder import FolderTransport

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = "floor0123456789ab"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_server", os.path.join(ROOT, "bench", "server.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(nfs: str, rank: int, n: int, skipped: set[int]) -> None:
    transport = FolderTransport(nfs, RUN, rank, 2)
    sender = Sender(transport, budget_bytes=64 << 20)
    for i in range(n):
        x = torch.arange(64, dtype=torch.float32) - 32 + rank
        rec = PendingRecord(name=f"Functional.relu.{i}", step=0, inputs=snapshot(((x,), {})),
                            output=snapshot(torch.relu(x)), skip_reason="not wanted" if i in skipped else "")
        sender.submit(rec)
    sender.close(timeout=30)


def test_the_floor_replays_what_the_server_replays_rank_by_rank(tmp_path):
    bench = _bench()
    nfs = str(tmp_path / "nfs")
    os.makedirs(nfs)
    _write(nfs, 0, 5, skipped={3})
    _write(nfs, 1, 2, skipped=set())
    seqs = [int(rec.header.seq) for rec, _ in bench._folder_records(nfs, 0)]
    assert seqs == sorted(seqs) and len(seqs) == 5, "every record of the rank, in sequence order"
    both = bench.replay_floor(nfs, [0, 1], workers=1)
    assert (both["records"], both["replayed"], both["full_backward"]) == (7, 6, 0)
    one = bench.replay_floor(nfs, [1], workers=2)
    assert (one["records"], one["replayed"]) == (2, 2)
    assert os.listdir(os.path.join(nfs, "rank0")), "the floor reads the folder and leaves it as it is"


def test_the_floor_leaves_the_grad_mode_and_thread_count_as_they_were(tmp_path):
    """The floor disables grad as the server's workers do: called in a test's process, it must not leave it so
    (the next test's autograd would find no graph)."""
    bench = _bench()
    nfs = str(tmp_path / "nfs")
    os.makedirs(nfs)
    _write(nfs, 0, 2, skipped=set())
    threads = torch.get_num_threads()
    assert bench.replay_floor(nfs, [0], workers=2)["replayed"] == 2
    assert torch.is_grad_enabled() and torch.get_num_threads() == threads


def test_the_floor_takes_its_turn_in_every_round_and_its_fastest_is_kept():
    """--rounds: the floor (None) runs in every round with the server codes, in the reverse order every other
    round, and the floor printed is the fastest round's time and the least CPU, not the first round's."""
    bench = _bench()
    codes = [("a",), ("b",)]
    assert [bench.turns(codes, r) for r in range(3)] == [[None, ("a",), ("b",)], [("b",), ("a",), None],
                                                         [None, ("a",), ("b",)]]
    runs = [{"seconds": 35.1, "cpu": 34.0, "decode": 0.6, "records": 7, "replayed": 6},
            {"seconds": 30.1, "cpu": 34.5, "decode": 0.5, "records": 7, "replayed": 6}]
    assert bench.fastest_floor(runs) == {"seconds": 30.1, "cpu": 34.0, "decode": 0.5, "records": 7, "replayed": 6}


def test_second_device_records_hold_matmuls_the_host_rounds_otherwise(tmp_path):
    """--second-device: the recorded training runs tests/second_device.py's kernels, so its linear outputs differ from
    what the host computes from the same recorded inputs (as a real device's do), where a plain recording's equal
    them bit for bit."""
    import argparse

    import torch.nn.functional as F

    from gpu_server.decode import decode_job
    from gpu_server.judging.bits import same_bits

    bench = _bench()

    def linears(second: bool) -> tuple[int, int]:
        work = str(tmp_path / ("second" if second else "host"))
        ns = argparse.Namespace(steps=1, layers=1, d=64, seq=16, batch=2, ranks=1, second_device=second)
        bench.train(work, ns, checked=True)
        same = differ = 0
        for record, payload in bench._folder_records(os.path.join(work, "nfs"), 0):
            job = decode_job(record, payload)
            if job.api != "linear" or job.output is None:
                continue
            host = F.linear(*job.args, **job.kwargs)
            if same_bits(host, job.output):
                same += 1
            else:
                differ += 1
        return same, differ

    same, differ = linears(second=False)
    assert same > 0 and differ == 0
    same, differ = linears(second=True)
    assert differ > 0 and same == 0


def test_each_server_run_says_where_its_cpu_went(tmp_path):
    """Under each server line, the server's CPU by thread role and its replay workers' (summary.json `cpu_s`), from
    a real gpu-server on a recorded folder; nothing from a server that does not say (an older --baseline tree)."""
    bench = _bench()
    nfs = str(tmp_path / "nfs")
    os.makedirs(nfs)
    _write(nfs, 0, 4, skipped=set())
    work = str(tmp_path / "work")
    os.makedirs(work)
    seconds, records, cpu, graphs, line = bench.serve(work, nfs, 1, 1, "cpu")
    assert records == 4 and cpu > 0
    # (4 small records: each thread role under the 0.1 s a role needs to be named; tests/test_e2e.py checks the split)
    assert line.startswith("its CPU: the server process ") and "its replay workers " in line, line
    assert bench.cpu_line(None) == ""
    split = bench.cpu_line({"process": 3.0, "replay_workers": 2.5, "rest": 1.0,
                            "threads": {"gpu-server-worker": 1.5, "MainThread": 0.45, "gpu-server-spool": 0.05}})
    assert split == ("its CPU: the server process 3.0 s (gpu-server-worker 1.5, MainThread 0.5, the rest 1.1), its "
                     "replay workers 2.5 s")
