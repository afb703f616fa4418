"""The online check end to end (issue 2): a real gpu-server process, real gRPC, real training runs."""
import glob
import json
import os

import grpc
import pytest
import torch

from gpu_server.columns import DETAILS_HEADER, PRECISION_DETAILS_HEADER, PRECISION_RESULT_HEADER, RESULT_HEADER
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from protos.contract import STREAM_METHOD
from tests.support import Server, agent_config, by_name, read_csv, read_header, run_training

TRAIN = r"""
import json, sys, torch
from examples.demo import train
_, losses, counts = train(sys.argv[1], steps=2, dtype=getattr(torch, sys.argv[2]), dropout=float(sys.argv[3]))
print("COUNTS " + json.dumps(counts))
"""

INPLACE = r"""
import sys, torch, torch.nn.functional as F
from npu_agent import PrecisionDebugger
torch.manual_seed(0)
dbg = PrecisionDebugger(config_path=sys.argv[1])
x, y = torch.randn(8, 8), torch.randn(8, 8)
dbg.start()
t = x.clone()
t.add_(y)
t.mul_(3.0)
F.relu_(t)
t += y
t[0] = 5.0
torch.relu_(t)
dbg.stop()
dbg.close()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("e2e"))
    with Server(work) as srv:
        yield srv


def _counts(proc) -> dict:
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COUNTS "))
    return json.loads(line[len("COUNTS "):])


def _train(server, tmp_path, dtype: str, rank: int, dropout: float = 0.1) -> dict:
    cfg = agent_config(str(tmp_path / f"agent_{rank}.json"), server.port)
    proc = run_training(TRAIN, cfg, dtype, str(dropout), env={"RANK": str(rank)})
    return _counts(proc)


def test_training_runs_get_one_row_per_forward_call_and_no_error(server, tmp_path):
    runs = {0: ("bfloat16", _train(server, tmp_path, "bfloat16", 0)),
            1: ("float32", _train(server, tmp_path, "float32", 1, dropout=0.0))}
    server.stop()
    assert "Traceback" not in server.log()
    for rank, (dtype, counts) in runs.items():
        assert counts["unacknowledged"] == 0 and counts["dropped"] == 0 and counts["rejected"] == 0, counts
        results = read_csv(server.out, "accuracy_checking_result", rank)
        assert len(results) == counts["forward_calls"], (dtype, len(results), counts)
        keys = [(r["Step"], r["API name"]) for r in results]
        assert len(keys) == len(set(keys)), "a call was reported twice"
        assert read_header(server.out, "accuracy_checking_result", rank)[:4] == RESULT_HEADER
        assert read_header(server.out, "accuracy_checking_details", rank)[:len(DETAILS_HEADER)] == DETAILS_HEADER
        assert read_header(server.out, "api_precision_compare_result", rank)[:4] == PRECISION_RESULT_HEADER
        assert read_header(server.out, "api_precision_compare_details", rank)[:len(PRECISION_DETAILS_HEADER)] == \
            PRECISION_DETAILS_HEADER
        bad = [r for r in results if "error" in (r["Forward Test Success"], r["Backward Test Success"])]
        assert not bad, (dtype, bad[:5])
        precision = read_csv(server.out, "api_precision_compare_result", rank)
        assert len(precision) == len(results)
        assert not [r for r in precision if "error" in (r["Forward Test Success"], r["Backward Test Success"])]
        # backward rows exist for the APIs that had a gradient
        linear = by_name([r for r in results if r["Step"] == "0"])["Functional.linear.0"]
        assert linear["Backward Test Success"] == "pass"
        details = {r["API Name"] for r in read_csv(server.out, "accuracy_checking_details", rank)}
        assert "Functional.linear.0.backward.output.1" in details
    (summary_path,) = glob.glob(os.path.join(server.out, "summary_*.json"))
    with open(summary_path) as fh:
        summary = json.load(fh)
    assert summary["calls_checked"]["0"] == runs[0][1]["forward_calls"]
    # where the server's CPU went (gpu_server/reports/cpu_use.py): its checking threads, its gRPC intake and its
    # replay worker processes (replays in processes: the default) each spent some; the split is within the whole
    cpu = summary["cpu_s"]
    assert cpu["threads"]["gpu-server-worker"] > 0 and cpu["threads"]["gpu-server-grpc"] > 0, cpu
    assert cpu["replay_workers"] > 0, cpu
    assert sum(cpu["threads"].values()) <= cpu["process"] + 0.05 and cpu["rest"] >= 0, cpu


def test_inplace_apis_are_replayed_from_their_inputs_before_the_call(tmp_path):
    with Server(str(tmp_path)) as srv:
        run_training(INPLACE, agent_config(str(tmp_path / "agent.json"), srv.port))
        srv.stop()
    rows = by_name(read_csv(srv.out, "accuracy_checking_result"))
    for name in ("Tensor.add_.0", "Tensor.mul_.0", "Functional.relu_.0", "Tensor.add_.1", "Tensor.__setitem__.0",
                 "Functional.relu_.1"):  # torch.relu_ is F.relu_
        assert rows[name]["Forward Test Success"] == "pass", rows.get(name)
    details = by_name(read_csv(srv.out, "accuracy_checking_details"), "API Name")
    assert float(details["Tensor.mul_.0.forward.output.0"]["最大绝对误差"]) < 1e-5  # fp32 rounding only


def _raw_record(name: str, seq: int, tensors=(), corrupt=False) -> list[bytes]:
    rec = PendingRecord(name=name, step=0, seq=seq)
    rec.inputs = snapshot((tuple(tensors), {}))
    rec.output = snapshot(tensors[0] * 2 if tensors else None)
    enc = encode_record(rec, "rawclient", 0)
    if corrupt:
        record = enc.record
        record.tensors[0].nbytes += 4   # bytes no longer match the shape
        enc.serialized = record.SerializeToString()   # the bytes the frames carry
    return list(enc.wire_frames(1 << 20))


def test_malformed_record_and_unknown_api_get_an_error_answer_and_a_skip_row(tmp_path):
    with Server(str(tmp_path)) as srv:
        channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
        stream = channel.stream_stream(STREAM_METHOD, request_serializer=None,
                                       response_deserializer=pb.Ack.FromString)
        x = torch.randn(3, 4)
        frames = (_raw_record("Torch.definitely_not_an_api.0", 0, [x])
                  + _raw_record("Tensor.mul.0", 1, [x], corrupt=True)
                  + [b"\x80\x04\x95 not a protobuf frame"]
                  + _raw_record("Functional.relu.0", 2, [x]))
        acks = list(stream(iter(frames)))
        channel.close()
        srv.stop()
    assert [a.status for a in acks] == [pb.Ack.REJECTED, pb.Ack.REJECTED, pb.Ack.REJECTED, pb.Ack.ACCEPTED]
    assert "definitely_not_an_api" in acks[0].reason
    assert "bytes do not match shape" in acks[1].reason
    assert "not a valid Frame" in acks[2].reason
    rows = by_name(read_csv(srv.out, "accuracy_checking_result"))
    assert rows["Torch.definitely_not_an_api.0"]["Forward Test Success"] == "SKIP"
    assert "not an API" in rows["Torch.definitely_not_an_api.0"]["Message"]
    assert rows["Tensor.mul.0"]["Forward Test Success"] == "SKIP"
    assert "malformed" in rows["Tensor.mul.0"]["Message"]
    assert rows["Functional.relu.0"]["Forward Test Success"] in ("pass", "error")  # served after the bad ones
