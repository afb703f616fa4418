"""Device arguments are data (issue 24, item 7): 'cpu', 'cuda:0', 'npu:0' or a torch.device, given as `device=` or
positionally to `to`, are put on the bench device in the replay; calls that create a tensor from Python values
(`torch.tensor`, `as_tensor`, `full`, `zeros`, `ones`, `arange`, `linspace` with a device) are replayed and compared
like any API. "Rejected" is kept for records that break the wire contract (malformed, hostile, refused names); a
valid record the server cannot replay is counted `not_replayable` ("not replayable records" in the human summary)."""
from __future__ import annotations

import torch

from gpu_server.job import Job
from gpu_server.replay.run import prepare_inputs
from gpu_server.reports.summary import Summary
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import apis
from protos import online_check_pb2 as pb
from tests import support
from tests.test_durability import counts_of, summary_of

# An optimizer step (Adam, foreach) and the factory calls of the audit, under the agent. Prints "COUNTS {json}".
TRAIN = r'''
import json, sys, torch
from npu_agent import PrecisionDebugger
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
dbg = PrecisionDebugger(config_path=sys.argv[1])
for step in range(2):
    dbg.start()
    x = torch.randn(2, 4)
    a = torch.tensor(1.0, device='cpu')
    b = torch.zeros(3, device=torch.device('cpu'))
    c = torch.full((2,), 0.5, device='cpu')
    d = torch.arange(4, device='cpu')
    e = torch.as_tensor([1.0, 2.0], device='cpu')
    f = torch.ones(2, device='cpu')
    g = torch.linspace(0, 1, 5, device='cpu')
    h = x.to('cpu')
    loss = model(h).sum() + a + b.sum() + c.sum() + d.sum() + e.sum() + f.sum() + g.sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    dbg.stop()
    dbg.step()
print("COUNTS " + json.dumps(dbg.close()))
'''

RAW_RUN, RAW_RANK = "rawclient", 1


def _record(name: str, args: tuple, kwargs: dict, out, seq: int, corrupt: bool = False) -> list[bytes]:
    """One record's frames as a client sends them; `corrupt`: its first tensor's bytes no longer match its shape."""
    rec = PendingRecord(name=name, step=0, inputs=snapshot((args, kwargs)), output=snapshot(out), seq=seq)
    enc = encode_record(rec, RAW_RUN, RAW_RANK)
    if corrupt:
        record = enc.record
        record.tensors[0].nbytes += 4
        enc.serialized = record.SerializeToString()   # the bytes the frames carry
    return list(enc.wire_frames(1 << 20))


FACTORIES = ("Torch.tensor.0", "Torch.zeros.0", "Torch.full.0", "Torch.arange.0", "Torch.as_tensor.0", "Torch.ones.0",
             "Torch.linspace.0", "Tensor.to.0")


def test_device_strings_are_replayable_where_a_device_is_taken():
    for device in ("cpu", "cuda", "cuda:0", "npu:0", "npu:15"):
        assert apis.replayable("Torch", "tensor", (1.0,), {"device": device}) is None, device
        assert apis.replayable("Torch", "zeros", ((3,),), {"device": device, "dtype": torch.float16}) is None
        assert apis.replayable("Tensor", "to", (torch.ones(1), device)) is None
        assert apis.replayable("Tensor", "new_zeros", (torch.ones(1), (2,)), {"device": device}) is None
    assert apis.replayable("Torch", "full", ((2,), 0.5), {"device": torch.device("cpu")}) is None
    # only device strings, only where a device goes
    for why in (apis.replayable("Torch", "tensor", (1.0,), {"device": "/etc/passwd"}),
                apis.replayable("Torch", "tensor", (1.0,), {"device": "cpu; rm -rf /"}),
                apis.replayable("Torch", "zeros", ((3,),), {"device": ["cpu"]}),
                apis.replayable("Functional", "gelu", (torch.ones(1),), {"approximate": "cpu"}),
                apis.replayable("Torch", "add", (torch.ones(1), "cpu"))):
        assert why is not None and why.startswith("not replayable: "), why


def test_the_replay_puts_the_bench_device_where_the_device_string_was():
    bench = torch.device("meta")   # any device other than the recorded one
    job = Job(run_id="r", rank=0, step=0, seq=0, name="Torch.tensor.0", category="Torch", api="tensor",
              direction=pb.FORWARD, args=(1.0,), kwargs={"device": "npu:0", "dtype": torch.float32})
    args, kwargs, _ = prepare_inputs(job, bench, bench=True)
    assert args == (1.0,) and kwargs == {"device": bench, "dtype": torch.float32}
    job = Job(run_id="r", rank=0, step=0, seq=1, name="Tensor.to.0", category="Tensor", api="to",
              direction=pb.FORWARD, args=(torch.ones(2), "cuda:0"), kwargs={})
    args, kwargs, _ = prepare_inputs(job, bench, bench=False)
    assert args[1] == bench and args[0].device == bench


def test_the_human_summary_names_the_two_counts_apart():
    s = Summary()
    s.count("rejected", 1)
    s.count("not_replayable", 2)
    text = s.human()
    assert "rejected records (they break the wire contract: malformed, hostile, refused sizes or names): 1" in text
    assert "not replayable records (valid, but not replayable on this server: reported SKIP with the reason): 2" in text
    assert s.as_dict()["transport"]["not_replayable"] == 2


def test_factory_calls_with_devices_are_replayed_and_only_broken_records_are_rejected(tmp_path):
    work = str(tmp_path)
    with support.Server(work) as srv:
        proc = support.run_training(TRAIN, support.agent_config(f"{work}/agent.json", srv.port))
        # then, on another stream: a malformed record, a name the agent never sends, a valid record whose argument
        # is not replayable, and a factory with an NPU device string
        x = torch.randn(3, 4)
        frames = [pb.Frame(hello=pb.Hello(run_id=RAW_RUN, rank=RAW_RANK)).SerializeToString()]
        frames += _record("Tensor.mul.0", (x, 2), {}, x * 2, 0, corrupt=True)
        frames += _record("Torch.save.0", (x, str(tmp_path / "saved.pt")), {}, None, 1)
        frames += _record("Functional.gelu.0", (x,), {"approximate": "nope"}, x, 2)
        frames += _record("Torch.zeros.0", ((3,),), {"device": "npu:0"}, torch.zeros(3), 3)
        acks = support.stream_acks(srv.port, frames, lambda acks: len(acks) >= 4)
        assert srv.stop() == 0
        log = srv.log()
    counts = counts_of(proc)
    assert counts["rejected"] == 0 and counts["unacknowledged"] == 0 and counts["dropped"] == 0, counts
    assert "rejected" not in proc.stderr.lower(), proc.stderr[-3000:]
    rows = support.read_csv(srv.out, "accuracy_checking_result")
    training = support.by_name([r for r in rows if r["Step"] == "0"])
    assert len(rows) == counts["forward_calls"], (len(rows), counts)
    for name in FACTORIES:
        assert training[name]["Forward Test Success"] == "pass", training.get(name)
    assert not [r for r in rows if "as parameter 'device'" in r["Message"]], rows
    by_seq = {a.seq: a for a in acks}
    assert by_seq[0].status == pb.Ack.REJECTED and "bytes do not match shape" in by_seq[0].reason, by_seq[0]
    assert by_seq[1].status == pb.Ack.REJECTED and "not replayable" in by_seq[1].reason, by_seq[1]
    assert by_seq[2].status == pb.Ack.REJECTED and "'nope'" in by_seq[2].reason, by_seq[2]
    assert by_seq[3].status == pb.Ack.ACCEPTED, by_seq[3]
    raw = support.by_name(support.read_csv(srv.out, "accuracy_checking_result", RAW_RANK))
    assert set(raw) == {"Tensor.mul.0", "Torch.save.0", "Functional.gelu.0", "Torch.zeros.0"}, raw
    assert raw["Torch.zeros.0"]["Forward Test Success"] == "pass", raw["Torch.zeros.0"]   # 'npu:0' -> the bench
    for name in ("Tensor.mul.0", "Torch.save.0", "Functional.gelu.0"):
        assert raw[name]["Forward Test Success"] == "SKIP", raw[name]
    assert "not replayable" in raw["Functional.gelu.0"]["Message"], raw
    assert not (tmp_path / "saved.pt").exists()
    transport = summary_of(srv.out)["transport"]
    # the malformed record and the refused name break the wire contract; the gelu record is valid, not replayable
    assert (transport["rejected"], transport["not_replayable"]) == (2, 1), transport
    assert "rejected records (they break the wire contract: malformed, hostile, refused sizes or names): 2" in log
    assert "not replayable records (valid, but not replayable on this server: reported SKIP with the reason): 1" in log
