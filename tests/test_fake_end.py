"""Ends and ranks that cannot be faked (issue 21, item 4; docs/security.md, "Stop the server with fake end
messages"): a real `gpu-server --exit-when-done --world-size 2` on loopback, a real two-rank training that stays
connected, and a hostile client on its own connection. The client sends one record per rank of its own run and an
end for each, ends for the training's real runs, a record of rank 2 and records of more runs than --max-run-ranks:
the server keeps running until the training's own ranks end, then exits by itself; the rank and the runs beyond the
limits are refused with the reason and get no report files."""
from __future__ import annotations

import glob
import json
import os
import re
import time

from protos import online_check_pb2 as pb
from tests import support
from tests.test_hostile import RawStream, end, hello, relu_frames

# argv: config, gate file. Two steps of a small MLP, then waits (connected) until the gate file exists, then closes.
GATED_TRAIN = r'''
import json, os, sys, time, torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
dbg = PrecisionDebugger(config_path=sys.argv[1])
for step in range(2):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    dbg.start()
    F.cross_entropy(model(x), y).backward()
    dbg.stop()
    dbg.step()
deadline = time.time() + 120
while not os.path.exists(sys.argv[2]) and time.time() < deadline:
    time.sleep(0.05)
print("COUNTS " + json.dumps(dbg.close()))
'''


def test_a_client_cannot_end_the_training_ranks_nor_stop_the_server(tmp_path):
    work = str(tmp_path)
    gate = os.path.join(work, "gate")
    srv = support.Server(work, args=("--exit-when-done", "--world-size", "2", "--max-run-ranks", "6",
                                     "--replay-in", "thread")).start()
    try:
        cfg = support.agent_config(os.path.join(work, "agent.json"), srv.port, online_close_timeout_s=60)
        ranks = [support.Training(GATED_TRAIN, cfg, gate, env={"RANK": str(r), "WORLD_SIZE": "2"}, timeout=150)
                 for r in (0, 1)]
        deadline = time.time() + 90
        while (min(len(support.read_csv(srv.out, "accuracy_checking_result", r)) for r in (0, 1)) < 3
               and time.time() < deadline):
            time.sleep(0.1)
        real = dict((int(r), run) for run, r in re.findall(r"agent connected from \S+ run (\w+) rank (\d) of 2",
                                                             srv.log()))
        assert sorted(real) == [0, 1], srv.log()[-2000:]
        fake = RawStream(srv.port)
        fake.send(hello("fake"), *relu_frames("fake", 0, rank=0), *relu_frames("fake", 0, rank=1))
        answers = fake.wait(2)
        fake.send(end("fake", 0, 1), end("fake", 1, 1))            # its own ranks: counted, its connection sent them
        fake.send(end(real[0], 0, 1), end(real[1], 1, 1))          # the training's: came over another connection
        fake.send(*relu_frames("fake", 0, rank=2), end("fake", 2, 1))   # rank 2 of a world of 2
        for run in ("extra1", "extra2", "extra3"):                  # 4 (run, rank) pairs so far; the limit is 6
            fake.send(*relu_frames(run, 0))
        answers = fake.wait(11)
        time.sleep(1.0)
        still_running = srv.proc.poll() is None
        fake.close()
        time.sleep(0.5)
        running_after_close = srv.proc.poll() is None
        open(gate, "w").close()
        procs = [t.result(150) for t in ranks]
        code = srv.proc.wait(timeout=90)   # --exit-when-done: the training's two ranks ended
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    by_kind = [(a.seq, a.status, a.reason) for a in answers]
    assert [s for _, s, _ in by_kind[:2]] == [pb.Ack.ACCEPTED] * 2, by_kind
    own_ends, real_ends = by_kind[2:4], by_kind[4:6]
    assert all(s == pb.Ack.END_ACCEPTED and not why for _, s, why in own_ends), own_ends
    assert all(s == pb.Ack.END_ACCEPTED and "came over another connection" in why and "not counted" in why
               for _, s, why in real_ends), real_ends
    rank2, rank2_end = by_kind[6], by_kind[7]
    assert rank2[1] == pb.Ack.REJECTED and "rank 2 is not below the world size 2" in rank2[2], rank2
    assert "--world-size" in rank2[2] and "not counted" in rank2_end[2], rank2_end
    extras = by_kind[8:11]
    assert [s for _, s, _ in extras] == [pb.Ack.ACCEPTED, pb.Ack.ACCEPTED, pb.Ack.REJECTED], extras
    assert "--max-run-ranks" in extras[2][2] and "extra3" in extras[2][2], extras[2]
    assert still_running and running_after_close, "the client's own ends stopped the server while the training ran"
    assert code == 0, srv.log()[-3000:]
    for proc in procs:
        counts = json.loads([x for x in proc.stdout.splitlines() if x.startswith("COUNTS ")][-1][7:])
        assert counts["acknowledged"] == counts["captured"] > 0, counts
    with open(glob.glob(os.path.join(srv.out, "summary_*.json"))[0]) as fh:
        summary = json.load(fh)
    ended = {(e["run_id"], e["rank"]) for e in summary["ranks_ended"]}
    assert {(real[0], 0), (real[1], 1)} <= ended, ended
    assert not glob.glob(os.path.join(srv.out, "*_rank2.csv")), "a refused rank got report files"
    rows = support.read_csv(srv.out, "accuracy_checking_result", 0)
    assert not [r for r in rows if "--max-run-ranks" in r.get("Message", "")], "a refused run got a report row"
    log = srv.log()
    assert "came over another connection" in log and "still waiting for" in log, log[-3000:]


def test_an_end_counts_only_from_where_the_records_came():
    """The rules of Intake.end_backed in process: the connection (or certificate) that sent a rank's records, a
    connection that takes over a rank whose senders are all gone, a rank restored from the spool, --world-size and
    --max-run-ranks."""
    from gpu_server.config import ServerConfig
    from gpu_server.intake.admission import Intake
    from protos.limits import DEFAULT_LIMITS

    jobs: list = []
    intake = Intake(ServerConfig(), jobs.append, DEFAULT_LIMITS.replace(max_run_ranks=3), world_size=2)
    frame = pb.Frame.FromString(relu_frames("run", 0)[0])
    intake.origin_opened("conn:a")
    assert intake.submit(frame.record, frame.data, origin="conn:a").status == pb.Ack.ACCEPTED
    the_end = pb.End(run_id="run", rank=0, last_seq=1)
    assert intake.end_backed(the_end, "conn:a") == ""
    assert "came over another connection" in intake.end_backed(the_end, "conn:b")
    intake.adopt("run", 0, "conn:b")                    # its sender is still connected: nothing to take over
    assert "came over another connection" in intake.end_backed(the_end, "conn:b")
    assert intake.connected_keys() == [("run", 0)]
    intake.origin_closed("conn:a")                      # the agent reconnects over a new connection
    assert intake.connected_keys() == []
    intake.adopt("run", 0, "conn:b")
    assert intake.end_backed(the_end, "conn:b") == ""
    intake.mark_seen("old", 1, 0)                       # restored from the spool: nobody sent it in this process
    assert intake.end_backed(pb.End(run_id="old", rank=1), "conn:c") == ""
    assert "no record" in intake.end_backed(pb.End(run_id="never", rank=1), "conn:a")
    assert "not below the world size 2" in intake.end_backed(pb.End(run_id="run", rank=2), "conn:a")
    rank2 = pb.Frame.FromString(relu_frames("run", 0, rank=2)[0])
    ticket = intake.submit(rank2.record, rank2.data, origin="conn:a")
    assert ticket.status == pb.Ack.REJECTED and "--world-size" in ticket.reason
    third = pb.Frame.FromString(relu_frames("third", 0)[0])
    assert intake.submit(third.record, third.data, origin="conn:a").status == pb.Ack.ACCEPTED   # 3 pairs: the limit
    fourth = pb.Frame.FromString(relu_frames("fourth", 0)[0])
    ticket = intake.submit(fourth.record, fourth.data, origin="conn:a")
    assert ticket.status == pb.Ack.REJECTED and "--max-run-ranks" in ticket.reason
    assert [j.run_id for j in jobs] == ["run", "third"], "refused ranks and runs get no report row"
