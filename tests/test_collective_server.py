"""Collectives checked across ranks by a real gpu-server process on loopback (issue 22, items 2 and 5).

Four raw clients, one per rank, send real encoded `Distributed.*` records with their Collective field over the gRPC
wire: a correct all_reduce (each rank summed in its own order in bfloat16) passes on every rank; a call where rank 3
made an all_gather instead is an error on every rank; a collective rank 3 never made is SKIP naming rank 3 once the
ends arrive; a malformed Collective is rejected with its reason; a restart between the records of two ranks and of
the other two reports each record once. The report files, the summary JSON and the HTML report show it.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import signal
import time

import torch

from npu_agent.records import CollectiveCall, PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from tests import support

WORLD = 4
JOB = "train-collective"
RANKS = tuple(range(WORLD))
SERVER_ARGS = ("--world-size", str(WORLD), "--exit-when-done", "--replay-in", "thread", "--workers", "2")


def _inputs(seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + seq)
    return [torch.randn(256, generator=g).to(torch.bfloat16) for _ in RANKS]


def _sum_in_order(xs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What rank `rank` got from a ring all_reduce: the same sum, added in its own order, in bfloat16."""
    order = xs[rank:] + xs[:rank]
    acc = order[0].clone()
    for x in order[1:]:
        acc = acc + x
    return acc


def frames(rank: int, seq: int, name: str, x, out, group_seq: int, op: str = "sum", ranks=RANKS,
           group: str = "0") -> list[bytes]:
    rec = PendingRecord(name=name, step=0, inputs=snapshot(((x,), {})), output=snapshot(out), seq=seq,
                        collective=CollectiveCall(job=JOB, group=group, ranks=tuple(ranks), seq=group_seq, op=op))
    enc = encode_record(rec, f"run-r{rank}", rank)
    return list(enc.wire_frames(1 << 20))


def hello(rank: int) -> bytes:
    return pb.Frame(hello=pb.Hello(run_id=f"run-r{rank}", rank=rank, world_size=WORLD)).SerializeToString()


def end(rank: int, records: int) -> bytes:
    return pb.Frame(end=pb.End(run_id=f"run-r{rank}", rank=rank, captured=records, sent=records,
                               acknowledged=records, last_seq=records, world_size=WORLD, job=JOB)).SerializeToString()


def send(port: int, rank: int, records: list[list[bytes]], with_end: bool = True) -> list[pb.Ack]:
    """One stream of rank `rank`: its records (each a list of frames), then its end; the acknowledgements."""
    msgs = [hello(rank)] + [f for rec in records for f in rec]
    if with_end:
        msgs.append(end(rank, len(records)))
        return support.stream_acks(port, msgs, lambda acks: any(a.status == pb.Ack.END_ACCEPTED for a in acks), 60)
    return support.stream_acks(port, msgs, lambda acks: len(acks) >= len(records), 60)


def rows(out: str, kind: str, rank: int) -> list[dict]:
    return support.read_csv(out, kind, rank)


def collective_rows(out: str, rank: int) -> list[dict]:
    return support.read_csv(out, "collective_result", rank)


def wait_exit(server: support.Server, timeout: float = 60) -> int:
    assert server.proc is not None
    try:
        return server.proc.wait(timeout)
    finally:
        server.stop()


def test_collectives_matched_mismatched_missing_and_malformed(tmp_path):
    work = str(tmp_path)
    xs0, xs1, xs2 = _inputs(0), _inputs(1), _inputs(2)
    with support.Server(work, args=SERVER_ARGS) as server:
        out = server.out
        acks = {}
        for rank in RANKS:
            recs = [frames(rank, 0, "Distributed.all_reduce.0", xs0[rank], _sum_in_order(xs0, rank), 0)]
            if rank < 3:
                recs.append(frames(rank, 1, "Distributed.all_reduce.1", xs1[rank], _sum_in_order(xs1, rank), 1))
                recs.append(frames(rank, 2, "Distributed.all_reduce.2", xs2[rank], _sum_in_order(xs2, rank), 2))
            else:   # rank 3 made an all_gather where the others all-reduced, and never made the third collective
                recs.append(frames(rank, 1, "Distributed.all_gather.0", xs1[rank], list(xs1), 1, op=""))
            if rank == 0:   # malformed: a group rank 0 is not in, a reduce op that does not exist
                recs.append(frames(rank, 3, "Distributed.all_reduce.3", xs0[0], xs0[0], 3, ranks=(1, 2)))
                recs.append(frames(rank, 4, "Distributed.all_reduce.4", xs0[0], xs0[0], 3, op="xor"))
            if rank == 3:
                time.sleep(0.5)   # the other ranks' records are in before rank 3 ends
            acks[rank] = send(server.port, rank, recs)
        assert wait_exit(server) == 0, server.log()[-3000:]

    by_seq = {a.seq: a for a in acks[0] if a.status != pb.Ack.END_ACCEPTED}
    assert by_seq[0].status == pb.Ack.ACCEPTED
    assert by_seq[3].status == pb.Ack.REJECTED and "rank 0" in by_seq[3].reason and "not a member" in \
        by_seq[3].reason, by_seq[3]
    assert by_seq[4].status == pb.Ack.REJECTED and "reduce op 'xor'" in by_seq[4].reason, by_seq[4]

    for rank in RANKS:
        result = support.by_name(rows(out, "accuracy_checking_result", rank))
        details = support.by_name(rows(out, "accuracy_checking_details", rank), "API Name")
        coll = support.by_name(collective_rows(out, rank), "API Name")
        # the correct all_reduce: msprobe's rows say pass, the collective CSV says matched
        r = result["Distributed.all_reduce.0"]
        assert (r["Forward Test Success"], r["Backward Test Success"]) == ("pass", " "), r
        assert details["Distributed.all_reduce.0.forward.output.0"]["Status"] == "pass"
        presult = support.by_name(rows(out, "api_precision_compare_result", rank), "API Name")
        assert presult["Distributed.all_reduce.0"]["Forward Test Success"] == "pass", presult
        c = coll["Distributed.all_reduce.0"]
        assert (c["Finding"], c["Status"], c["Group"], c["Ranks"], c["Group Seq"], c["Reduce Op"]) == \
            ("matched", "pass", "0", "0 1 2 3", "0", "sum"), c
        assert c["Dtype"] == "torch.bfloat16" and c["Shape"] == "(256,)" and c["Step"] == "0", c
        # the mismatch: an error on every rank, with the finding's message
        name = "Distributed.all_gather.0" if rank == 3 else "Distributed.all_reduce.1"
        assert result[name]["Forward Test Success"] == "error", result[name]
        assert coll[name]["Finding"] == "mismatch" and coll[name]["Status"] == "error", coll[name]
        assert coll[name]["Message"].strip() and result[name]["Message"].strip(), (coll[name], result[name])
        # the collective rank 3 never made: SKIP on the others, naming rank 3
        if rank < 3:
            r = result["Distributed.all_reduce.2"]
            assert r["Forward Test Success"] == "SKIP" and "3" in r["Message"], r
            assert coll["Distributed.all_reduce.2"]["Finding"] == "missing", coll
        else:
            assert "Distributed.all_reduce.2" not in result
        # each record once
        names = [x["API name"] for x in rows(out, "accuracy_checking_result", rank)]
        assert len(names) == len(set(names)), names
        assert len(collective_rows(out, rank)) == (3 if rank < 3 else 2)
    # the malformed records: rejected, reported SKIP with the reason, never in the collective CSV
    r0 = support.by_name(rows(out, "accuracy_checking_result", 0))
    assert r0["Distributed.all_reduce.3"]["Forward Test Success"] == "SKIP", r0
    assert "Distributed.all_reduce.3" not in {x["API Name"] for x in collective_rows(out, 0)}

    summary = json.load(open(glob.glob(os.path.join(out, "summary_*.json"))[0], encoding="utf-8"))
    c = summary["collectives"]
    assert c["records_by_finding"]["matched"] == 4 and c["records_by_finding"]["mismatch"] == 4, c
    assert c["records_by_finding"]["missing"] == 3, c
    assert c["collectives_by_finding"]["matched"] == 1 and c["collectives_by_finding"]["mismatch"] == 1, c
    assert c["ranks"] == [0, 1, 2, 3], c
    grid = {(g["api"], g["group"]): g["by_rank"] for g in c["grid"]}
    assert grid[("Distributed.all_reduce", "0")]["0"] == {"error": 1, "SKIP": 1, "pass": 1}, grid
    assert grid[("Distributed.all_gather", "0")] == {"3": {"error": 1}}, grid
    assert c["first"]["mismatch"]["message"] and c["first"]["missing"]["call"] == "Distributed.all_reduce.2", c
    assert any(f["finding"] == "missing" and 3 in f["named"] for f in c["findings"]), c["findings"]
    log = server.log()
    assert "mismatch" in log and "missing" in log, log[-3000:]   # summary.human(): one line per finding kind
    page = open(glob.glob(os.path.join(out, "report_*.html"))[0], encoding="utf-8").read()
    assert "id='collective-grid'" in page and "<th>rank 3</th>" in page and "Distributed.all_gather" in page
    assert "id='collective-findings'" in page


def test_a_restart_between_the_ranks_reports_each_collective_once(tmp_path):
    work = str(tmp_path)
    xs = _inputs(7)
    recs = {rank: [frames(rank, 0, "Distributed.all_reduce.0", xs[rank], _sum_in_order(xs, rank), 0)]
            for rank in RANKS}
    first = support.Server(work, args=SERVER_ARGS).start()
    out = first.out
    for rank in (0, 1):
        acks = send(first.port, rank, recs[rank], with_end=False)
        assert acks[0].status == pb.Ack.ACCEPTED, acks
    time.sleep(0.5)
    assert first.proc is not None
    first.proc.send_signal(signal.SIGTERM)   # not every run ended: the two records wait in the spool
    assert first.stop() == 0, first.log()[-3000:]
    for rank in RANKS:
        assert not [r for r in rows(out, "accuracy_checking_result", rank)
                    if r["API name"].startswith("Distributed.")], rank
    left = json.load(open(glob.glob(os.path.join(out, "summary_*.json"))[0], encoding="utf-8"))
    assert left["durability"]["collective_records_waiting_kept_in_spool"] == 2, left["durability"]

    second = support.Server(work, port=first.port, out=out, args=SERVER_ARGS).start()
    for rank in RANKS:
        acks = send(second.port, rank, recs[rank])   # ranks 0 and 1 send theirs again: DUPLICATE, never twice
        status = next(a.status for a in acks if a.status != pb.Ack.END_ACCEPTED)
        assert status == (pb.Ack.DUPLICATE if rank < 2 else pb.Ack.ACCEPTED), (rank, acks)
    assert wait_exit(second) == 0, second.log()[-3000:]
    for rank in RANKS:
        result = [r for r in rows(out, "accuracy_checking_result", rank) if r["API name"].startswith("Distributed.")]
        assert [(r["API name"], r["Forward Test Success"]) for r in result] == [("Distributed.all_reduce.0", "pass")]
        coll = collective_rows(out, rank)
        assert [(c["API Name"], c["Finding"], c["Status"]) for c in coll] == \
            [("Distributed.all_reduce.0", "matched", "pass")], coll
        path = glob.glob(os.path.join(out, f"collective_result_*_rank{rank}.csv"))[0]
        with open(path, encoding="utf-8-sig", newline="") as fh:
            assert next(csv.reader(fh))[:3] == ["API Name", "Group", "Ranks"]
    summary = json.load(open(glob.glob(os.path.join(out, "summary_*.json"))[0], encoding="utf-8"))
    assert summary["collectives"]["records_by_finding"]["matched"] == 4, summary["collectives"]
