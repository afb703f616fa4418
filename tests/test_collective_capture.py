"""torch.distributed collectives captured for the check across ranks (issue 22; npu_agent/collectives.py).

Two real gloo ranks on the CPU (torch.multiprocessing spawn). Each rank runs the same workload twice: once without
the agent, once under the capture mode with a list sink, recording the ProcessGroup methods it calls both times
(capturing must add no communication); then the sampling, the error path. Each rank writes what it saw to a JSON
file the test reads.
"""
from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _plain(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, slice):
        return repr(obj)
    return obj


def _sink(out: list[dict]):
    def sink(rec) -> None:   # what the record holds when it is submitted (the sender would encode it later)
        c = rec.collective
        out.append({"name": rec.name, "step": rec.step, "skip": rec.skip_reason,
                    "coll": None if c is None else [c.job, c.group, list(c.ranks), c.seq, c.op, c.root, c.async_op,
                                                    c.error, c.unfinished],
                    "inputs": None if rec.inputs is None or rec.inputs.tree is None else _plain(rec.inputs.tree),
                    "output": None if rec.output is None or rec.output.tree is None else _plain(rec.output.tree),
                    "backward_expected": rec.backward_expected})
    return sink


class _AllReduceGrad(torch.autograd.Function):   # tensor-parallel style: the backward all-reduces the gradient
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


def _workload(rank: int, sub, log: list[str]) -> None:
    """The training's calls; `log` gets the pending async Work that is never waited on before the step boundary."""
    import torch.distributed._functional_collectives as fc

    r = float(rank + 1)
    t = torch.full((3,), r)
    dist.all_reduce(t)                                        # inputs r, output 3
    m = torch.full((2,), r)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    b = torch.full((2,), 10.0 + rank)
    dist.broadcast(b, src=1)                                  # -> 11
    red = torch.full((2,), r)
    dist.reduce(red, dst=0)
    gl = [torch.zeros(2) for _ in range(WORLD)]
    dist.all_gather(gl, torch.full((2,), r))
    big = torch.zeros(4)
    dist.all_gather_into_tensor(big, torch.full((2,), r))
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, torch.arange(4.0) + rank)
    rl = torch.zeros(1)
    dist.reduce_scatter(rl, [torch.full((1,), r), torch.full((1,), 2 * r)])
    a2 = [torch.zeros(1) for _ in range(WORLD)]
    dist.all_to_all(a2, [torch.full((1,), 10 * r + i) for i in range(WORLD)])
    a2s = torch.zeros(3)
    ins = [1, 2] if rank == 0 else [2, 1]
    outs = [1, 2] if rank == 0 else [2, 1]
    dist.all_to_all_single(a2s, torch.arange(3.0) + 10 * rank, output_split_sizes=outs, input_split_sizes=ins)
    msg = torch.full((2,), 7.0 + rank)
    got = torch.zeros(2)
    if rank == 0:
        dist.send(msg, dst=1)
        dist.recv(got, src=1)
        dist.isend(msg, dst=1).wait()
    else:
        dist.recv(got, src=0)
        dist.send(msg, dst=0)
        dist.irecv(got, src=0).wait()
    dist.all_reduce(torch.full((2,), r) * 1, async_op=True).wait()   # output taken at wait
    a = torch.full((2,), 100.0 * r)
    w = dist.all_reduce(a, async_op=True)
    w.wait()
    dist.all_reduce(torch.full((1,), r), group=sub)           # a subgroup of its own
    x = torch.full((2,), r, requires_grad=True)
    _AllReduceGrad.apply(x).sum().backward()                  # all_reduce inside the backward
    assert x.grad.tolist() == [float(WORLD)] * 2
    y = fc.all_reduce(torch.full((2,), 5 * r), "sum", dist.group.WORLD)   # functional: waited at first use
    assert (y + 0).tolist() == [15.0, 15.0]
    z = torch.ops._c10d_functional.all_reduce(torch.full((2,), 5 * r), "max", "0")
    z = torch.ops._c10d_functional.wait_tensor(z)
    sc = torch.zeros(1)
    dist.scatter(sc, [torch.ones(1), torch.ones(1)] if rank == 0 else None, src=0)   # not checked: a SKIP record
    never = dist.all_reduce(torch.full((1,), r), async_op=True)   # waited only after the step boundary
    log.append(never)


def _calls_of_process_groups(log: list[str]):
    """Wrap every public ProcessGroup method: the sequence of communication calls a rank makes."""
    pg_cls = dist.ProcessGroup
    originals = {}
    for name in ("allreduce", "broadcast", "reduce", "allgather", "_allgather_base", "allgather_into_tensor_coalesced",
                 "reduce_scatter", "_reduce_scatter_base", "alltoall", "alltoall_base", "send", "recv",
                 "recv_anysource", "barrier", "allreduce_coalesced", "gather", "scatter", "monitored_barrier"):
        fn = getattr(pg_cls, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def wrapper(self, *args, __name=name, __fn=fn, **kwargs):
            log.append(__name)
            return __fn(self, *args, **kwargs)

        setattr(pg_cls, name, wrapper)
    return originals


def _rank_main(rank: int, init_file: str, result_dir: str) -> None:
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=30))
        from npu_agent.capture import CaptureMode, Capturer
        from npu_agent.sampling import Policy, Sampler

        sub = dist.new_group([1, 0])
        pg_calls: list[str] = []
        _calls_of_process_groups(pg_calls)
        never: list = []
        _workload(rank, sub, never)                    # without the agent
        never.pop().wait()
        plain = list(pg_calls)
        pg_calls.clear()
        records: list[dict] = []
        cap = Capturer(_sink(records), locate=False)
        with CaptureMode(cap):
            _workload(rank, sub, never)
        cap.next_step(1)                               # the step boundary: the Work never waited on goes out
        never.pop().wait()                             # ... and its late wait adds nothing
        captured = list(pg_calls)

        # sampling: every step sampled, ranks in turn (online_sample_ranks=2): collectives still decided alike
        sampled: list[dict] = []
        cap2 = Capturer(_sink(sampled), locate=False, sampler=Sampler(Policy(1, 2, 1, 0.0), rank))
        for step in range(4):
            cap2.next_step(step)
            with CaptureMode(cap2):
                for _ in range(2):
                    t = torch.ones(4) * (rank + 1)
                    t = t + 1                          # a plain call: rank-rotation applies
                    dist.all_reduce(t)
                    dist.all_reduce(t[:2].contiguous(), op=dist.ReduceOp.MAX)
        sample_counts = cap2.sampler.report()

        # the error path: rank 0's all_reduce on a group with a short timeout that rank 1 never joins
        # (made right after a barrier: the group's own rendezvous is held to that timeout too)
        dist.barrier()
        slow = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=5))
        failed: list[dict] = []
        raised = ""
        if rank == 0:
            cap3 = Capturer(_sink(failed), locate=False)
            try:
                with CaptureMode(cap3):
                    dist.all_reduce(torch.ones(2), group=slow)
            except Exception as exc:   # noqa: BLE001
                raised = type(exc).__name__ + ": " + str(exc)[:200]
        dist.barrier()
        result = {"records": records, "plain": plain, "captured": captured, "sampled": sampled,
                  "sample_counts": sample_counts, "failed": failed, "raised": raised}
        with open(os.path.join(result_dir, f"{rank}.json"), "w") as fh:
            json.dump(result, fh)
        dist.barrier()   # both results written before either rank closes its connections
    except BaseException:   # noqa: BLE001 - reported to the parent
        with open(os.path.join(result_dir, f"{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
    # No teardown: the group whose all_reduce timed out still has gloo's work on it, and destroying it (or the other
    # rank closing its connections first) can end in std::terminate inside gloo under load ("terminate called
    # without an active exception", SIGABRT), which is gloo's and not what these tests check.
    os._exit(0)


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank_main, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=False,
                                 start_method="spawn")
        end = time.monotonic() + 90
        while True:
            try:
                if ctx.join(timeout=1):
                    break
            except mp.ProcessExitedException:
                # a rank that wrote its results and then died in gloo's own teardown: its results stand
                if not all(os.path.exists(os.path.join(tmp, f"{r}.json")) for r in range(WORLD)):
                    raise
                break
            if time.monotonic() > end:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail("the gloo ranks did not finish within 90 s")
        errors = {r: open(os.path.join(tmp, f"{r}.err")).read() for r in range(WORLD)
                  if os.path.exists(os.path.join(tmp, f"{r}.err"))}
        assert not errors, "\n".join(f"rank {r}:\n{m}" for r, m in errors.items())
        out = {}
        for r in range(WORLD):
            with open(os.path.join(tmp, f"{r}.json")) as fh:
                out[r] = json.load(fh)
        return out


def _by_name(recs: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in recs}


def test_every_rank_gives_each_collective_the_same_job_group_ranks_and_seq(ranks):
    a, b = (_by_name(ranks[r]["records"]) for r in range(WORLD))
    coll = [n for n, r in a.items() if r["coll"] is not None and r["coll"][1] != "p2p"]
    assert len(coll) >= 14, sorted(a)
    for name in coll:
        assert name in b, name
        assert a[name]["coll"][:6] == b[name]["coll"][:6], (name, a[name]["coll"], b[name]["coll"])
    job = a["Distributed.all_reduce.0"]["coll"][0]
    assert len(job) == 16 and all(r["coll"][0] == job for r in a.values() if r["coll"])
    # default group "0", ranks (0, 1), seq in call order; the subgroup counts on its own
    world = [a[n]["coll"] for n in coll if a[n]["coll"][1] == "0"]
    assert sorted(c[3] for c in world) == list(range(len(world)))
    assert a["Distributed.all_reduce.0"]["coll"][1:6] == ["0", [0, 1], 0, "sum", -1]
    assert a["Distributed.all_reduce.1"]["coll"][4] == "max"
    assert a["Distributed.broadcast.0"]["coll"][5] == 1 and a["Distributed.reduce.0"]["coll"][5] == 0
    subs = [c for c in (a[n]["coll"] for n in coll) if c[1] != "0"]
    assert len(subs) == 1 and subs[0][2] == [0, 1] and subs[0][3] == 0   # new_group sorts its ranks
    for r in a.values():
        assert not r["backward_expected"]


def test_inputs_are_before_the_call_and_outputs_after(ranks):
    for rank in range(WORLD):
        rec = _by_name(ranks[rank]["records"])
        v = float(rank + 1)
        ar = rec["Distributed.all_reduce.0"]
        assert ar["inputs"] == [[[v] * 3], {}] and ar["output"] == [3.0] * 3 and not ar["skip"]
        assert rec["Distributed.broadcast.0"]["inputs"] == [[[10.0 + rank] * 2], {}]
        assert rec["Distributed.broadcast.0"]["output"] == [11.0, 11.0]
        assert rec["Distributed.all_gather.0"]["inputs"] == [[[v, v]], {}]
        assert rec["Distributed.all_gather.0"]["output"] == [[1.0, 1.0], [2.0, 2.0]]
        assert rec["Distributed.all_gather_into_tensor.0"]["output"] == [1.0, 1.0, 2.0, 2.0]
        assert rec["Distributed.reduce_scatter_tensor.0"]["inputs"] == [[[0.0 + rank, 1.0 + rank, 2.0 + rank,
                                                                            3.0 + rank]], {}]
        assert rec["Distributed.reduce_scatter.0"]["inputs"] == [[[[v], [2 * v]]], {}]
        assert rec["Distributed.reduce_scatter.0"]["output"] == [[3.0], [6.0]][rank]
        assert rec["Distributed.all_to_all.0"]["output"] == [[10.0 + rank], [20.0 + rank]]
        a2s = rec["Distributed.all_to_all_single.0"]
        ins = [1, 2] if rank == 0 else [2, 1]
        assert a2s["inputs"][1] == {"output_split_sizes": ins, "input_split_sizes": ins}
        # async: the output of the waited all_reduce is the sum, taken at wait
        async_recs = [r for r in rec.values() if r["coll"] and r["coll"][6] and r["coll"][1] == "0"
                      and r["name"].startswith("Distributed.all_reduce")]
        done = [r for r in async_recs if not r["coll"][8]]
        assert any(r["output"] == [300.0, 300.0] and r["inputs"] == [[[100.0 * v] * 2], {}] for r in done), done
        # the Work never waited on by the step boundary: unfinished, no output
        unfinished = [r for r in async_recs if r["coll"][8]]
        assert len(unfinished) == 1 and unfinished[0]["output"] is None and unfinished[0]["coll"][7] == ""


def test_collective_in_a_custom_backward_and_functional_collectives(ranks):
    for rank in range(WORLD):
        recs = ranks[rank]["records"]
        grads = [r for r in recs if r["name"].startswith("Distributed.all_reduce") and r["inputs"] == [[[1.0, 1.0]], {}]
                 and r["output"] == [2.0, 2.0]]
        assert grads, "the all_reduce of the custom backward was not captured"
        functional = [r for r in recs if r["coll"] and r["inputs"] == [[[5 * (rank + 1.0)] * 2], {}]
                      and r["output"] in ([15.0, 15.0], [10.0, 10.0])]
        ops = sorted(r["coll"][4] for r in functional if r["coll"][6])
        assert ops == ["max", "sum"], [r["name"] for r in functional]
        scatter = _by_name(recs)["Distributed.scatter.0"]
        assert "not checked" in scatter["skip"] and scatter["coll"] is None


def test_send_and_recv_pair_up(ranks):
    a, b = (_by_name(ranks[r]["records"]) for r in range(WORLD))
    assert a["Distributed.send.0"]["coll"][1:4] == ["p2p", [0, 1], 0] and a["Distributed.send.0"]["output"] is None
    assert b["Distributed.recv.0"]["coll"][1:4] == ["p2p", [0, 1], 0] and b["Distributed.recv.0"]["output"] == [7.0] * 2
    assert b["Distributed.recv.0"]["inputs"] == [[], {}]
    assert b["Distributed.send.0"]["coll"][1:6] == ["p2p", [1, 0], 0, "", 0]
    assert a["Distributed.recv.0"]["coll"][1:6] == ["p2p", [1, 0], 0, "", 1]
    assert a["Distributed.isend.0"]["coll"][1:4] == ["p2p", [0, 1], 1]
    irecv = b["Distributed.irecv.0"]
    assert irecv["coll"][1:4] == ["p2p", [0, 1], 1] and irecv["output"] == [7.0, 7.0] and not irecv["coll"][8]


def test_capture_adds_no_communication(ranks):
    for rank in range(WORLD):
        assert ranks[rank]["plain"] and ranks[rank]["plain"] == ranks[rank]["captured"]


def test_sampling_decisions_are_equal_across_ranks(ranks):
    names = [[(r["step"], r["name"], r["coll"][3] if r["coll"] else None) for r in ranks[k]["sampled"]
              if r["name"].startswith("Distributed.")] for k in range(WORLD)]
    assert names[0] == names[1] and names[0]
    plain = [{r["step"] for r in ranks[k]["sampled"] if r["name"].startswith("Tensor.")} for k in range(WORLD)]
    assert plain[0] != plain[1]   # the rank rotation still applies to the other calls
    # coverage 1: each collective call site once a step, the second call of the step skipped
    assert len(names[0]) == 4 * 2
    counts = ranks[0]["sample_counts"]
    assert counts["skipped_repeats"] >= 8 and counts["call_sites"] >= 3


def test_a_collective_that_times_out_is_recorded_with_its_error(ranks):
    assert ranks[0]["raised"], "the all_reduce on the short-timeout group did not raise"
    (rec,) = [r for r in ranks[0]["failed"] if r["name"].startswith("Distributed.")]
    assert rec["name"] == "Distributed.all_reduce.0" and rec["output"] is None
    assert rec["coll"][8] and rec["coll"][7] and rec["coll"][7][:40] in ranks[0]["raised"]
