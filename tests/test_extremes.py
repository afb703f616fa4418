"""gpu_server/judging/extremes.py: one read of an output's extremes serves its finiteness and the metrics' first
pass, with the answers of two reads; and a backward's check reads its forward's input finiteness."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_server.judging import extremes, metrics
from gpu_server.judging.nonfinite import CallFiniteness, finite


@pytest.fixture
def reads(monkeypatch):
    """The tensors torch.aminmax was called on, through extremes."""
    seen: list[torch.Tensor] = []
    real = torch.aminmax

    def counting(t, *a, **k):
        seen.append(t)
        return real(t, *a, **k)

    monkeypatch.setattr(extremes.torch, "aminmax", counting)
    return seen


def test_the_finiteness_read_serves_the_metrics_and_changes_no_value(reads):
    g = torch.Generator().manual_seed(3)
    bench = torch.randn(4, 1000, generator=g, dtype=torch.float64)
    device = (bench + 1e-4 * torch.randn(4, 1000, generator=g, dtype=torch.float64)).float()
    alone = metrics.analyse(bench, device)
    n_alone = len(reads)
    assert n_alone == 2                                     # the metrics' first pass: each side once
    reads.clear()
    with extremes.remembered():
        assert finite(device) and finite(bench, torch.float32)
        assert len(reads) == 2
        shared = metrics.analyse(bench, device)
    assert len(reads) == 2                                  # the metrics read nothing again
    assert dataclasses.asdict(shared.metrics) == dataclasses.asdict(alone.metrics)
    assert shared.cosine == alone.cosine


def test_an_output_longer_than_a_chunk_is_read_by_chunks_as_before(reads):
    t = torch.randn(10_000, dtype=torch.float64)
    with extremes.remembered():
        finite(t)
        metrics.analyse(t, t.float(), chunk_elements=4096)
    # the whole for its finiteness; the metrics' chunks of each side (3 + 3) are other memory ranges
    assert len(reads) == 1 + 6


def test_no_memory_without_a_block_a_write_or_a_strided_view(reads):
    t = torch.randn(100)
    finite(t)
    finite(t)
    assert len(reads) == 2                                  # outside a block: every read reads
    reads.clear()
    with extremes.remembered():
        assert finite(t) and finite(t.detach().reshape(-1))
        assert len(reads) == 1                              # another view of the same elements: remembered
        t[7] = float("nan")                                 # an in-place write raises the version
        assert not finite(t)
        assert len(reads) == 2
        s = torch.randn(10, 10)
        finite(s.t())
        finite(s.t())
        assert len(reads) == 4                              # a strided view is not remembered
    with extremes.remembered():
        finite(t)
    assert len(reads) == 5                                  # a new block starts empty


def test_blocks_nest_and_threads_keep_their_own():
    t = torch.randn(5)
    with extremes.remembered():
        extremes.aminmax(t)
        outer = extremes._local.memo
        with extremes.remembered():
            assert extremes._local.memo == {}
        assert extremes._local.memo is outer
    assert extremes._local.memo is None


def test_a_backward_check_reads_its_forward_inputs_finiteness(monkeypatch, tmp_path):
    """Real records of a real training step through a server worker: each forward's inputs are measured once (by its
    forward's check), and a backward whose forward received a NaN is told so all the same."""
    from gpu_server.checking import checker as checker_module
    from gpu_server.checking.checker import Checker
    from gpu_server.checking.pending import PendingCalls
    from gpu_server.checking.workers import Worker
    from gpu_server.reports.rank_reports import Reports
    from gpu_server.reports.summary import Summary
    from tests.support import capture, to_job

    lin = torch.nn.Linear(8, 8)
    with torch.no_grad():
        lin.weight[2, 3] = float("nan")                    # the training's own NaN, in a forward input
    x = torch.randn(4, 8)
    with capture() as (mode, sink):
        with mode:
            y = torch.relu(lin(x))
        y.sum().backward()
    measured, told = [], []
    real_all_finite, real_measure = checker_module.all_finite, CallFiniteness.measure
    monkeypatch.setattr(checker_module, "all_finite", lambda v: measured.append(v) or real_all_finite(v))
    monkeypatch.setattr(checker_module.CallFiniteness, "measure",
                        lambda inputs_finite, d, b: told.append(inputs_finite) or real_measure(inputs_finite, d, b))
    summary = Summary()
    worker = Worker(Checker(torch.device("cpu"), summary), Reports(str(tmp_path), "ts", summary.add_files),
                    PendingCalls(1 << 30, graph_budget=1 << 30))
    torch.set_grad_enabled(False)   # as in the worker threads
    try:
        jobs = [to_job(rec) for rec in sink]
        for seq, job in enumerate(jobs):
            job.seq = seq
            worker.check(job)
        worker.close()
    finally:
        torch.set_grad_enabled(True)
    forwards = [j for j in jobs if j.direction == 1]
    backwards = [j for j in jobs if j.direction == 2]
    assert len(forwards) == len(backwards) == 2            # linear and relu, each checked both ways
    # forward inputs: each measured once; the backwards measured only their grad_output
    assert sum(1 for v in measured if isinstance(v, tuple) and len(v) == 2 and v[0] is not None
               and any(v[0] is j.args for j in forwards)) == 2
    assert len(measured) == 4
    assert told.count(False) == 4                          # linear's inputs hold the NaN, relu's input carries it
    assert [j.inputs_finite for j in forwards] == [False, False]
