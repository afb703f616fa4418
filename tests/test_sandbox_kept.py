"""A replay worker process keeps a forward's autograd graphs without a copy of its record (gpu_server/replay/
sandbox_worker.py): the graphs read private copies of the inputs, so only the call's name and thread count are kept,
and the arena is free to be rewritten or replaced before the backward comes. A replay path that saved a tensor of
the record itself would make the call replay again from a private copy."""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from gpu_server.replay import sandbox_worker
from gpu_server.replay.sandbox import InlineReplayer, ProcessReplayer, SandboxLimits
from tests.support import capture, forked_replay_workers, to_job  # noqa: F401 - its replay workers forked

MiB = 1 << 20
CPU = torch.device("cpu")


def _training_records(width: int = 16):
    torch.manual_seed(2)
    lin = torch.nn.Linear(width, width)
    x = torch.randn(8, width, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            y = F.gelu(lin(x))
        (y * torch.arange(float(width))).sum().backward()
    return sink


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))
                                    for x, y in zip(a, b))


def test_a_kept_graph_survives_its_arena_being_rewritten_and_replaced():
    """Forward kept; then other records, one large enough that the server makes a new, larger arena (the worker
    maps the new one and closes the old); then the backward on the kept graphs: the inline replayer's gradients."""
    sink = _training_records()
    fwd, bwd = to_job(sink.forward("Functional.linear.0")), to_job(sink.backward("Functional.linear.0"))
    big = _training_records(width=640)                    # its linear's record is past the first 1 MiB arena
    others = [to_job(r) for r in big if r.direction == 1]
    inline = InlineReplayer(CPU)
    want_f = inline.forward(fwd, keep=True, match=True)
    want = inline.backward(fwd, bwd, want_f.kept, match=True)
    proc = ProcessReplayer(CPU, SandboxLimits(timeout_s=120), torch.get_num_threads(), 512 * MiB)
    try:
        got_f = proc.forward(fwd, keep=True, match=True)
        assert got_f.kept is not None and got_f.kept.bench is not None and got_f.kept.same is not None
        first_arena = proc.inbox.name
        for job in others:
            proc.forward(job, keep=False, match=True)
        assert proc.inbox.name != first_arena             # the arena the kept forward came in is gone
        got = proc.backward(fwd, bwd, got_f.kept, match=True)
        assert proc.replaced == 0
    finally:
        proc.close()
    assert _same(got_f.bench, want_f.bench) and _same(got_f.same, want_f.same)
    assert _same(got.bench, want.bench) and _same(got.same, want.same)


def _worker(tmp_path) -> sandbox_worker.Worker:
    ns = argparse.Namespace(device="cpu", memory=256 * MiB, rfd=-1, wfd=-1, max_record_bytes=0, folder=str(tmp_path))
    return sandbox_worker.Worker(ns)


def _request(job) -> tuple[dict, memoryview]:
    record, payload, _ = job.wire
    header = record.SerializeToString()
    arena = memoryview(bytes(header) + bytes(payload))
    ref = {"record": [0, len(header)], "payload": [len(header), len(payload)]}
    return {"keep": True, "match": True, "job": ref}, arena


def test_the_kept_job_holds_no_tensor_and_the_gradients_are_a_full_replays(tmp_path):
    sink = _training_records()
    fwd, bwd = to_job(sink.forward("Functional.linear.0")), to_job(sink.backward("Functional.linear.0"))
    worker = _worker(tmp_path)
    req, arena = _request(fwd)
    torch.set_grad_enabled(False)   # as in the worker process
    try:
        answer = worker.forward(req, arena)
        kept = [worker.kept[h] for h in answer["kept"]]
        assert all(job.args == () and job.wire is None and job.api == "linear" for _, job in kept)
        grads = [sandbox_worker.replay.backward_from(graph, job, bwd, CPU) for graph, job in kept]
        full = [sandbox_worker.replay.run_backward(fwd, bwd, CPU, bench=b) for b in (True, False)]
    finally:
        torch.set_grad_enabled(True)
    assert all(_same(g, f) for g, f in zip(grads, full))


def test_a_replay_that_saves_a_tensor_of_the_record_replays_from_a_private_copy(tmp_path, monkeypatch):
    sink = _training_records()
    fwd = to_job(sink.forward("Functional.linear.0"))
    real = sandbox_worker.replay.run_forward_kept
    seen = []

    def saving_the_record(job, device, bench, match_threads=True):
        out, graph = real(job, device, bench, match_threads)
        w = job.args[1]                                   # the record's own weight tensor
        seen.append(w.untyped_storage().data_ptr())
        with torch.enable_grad():
            out = out + (graph.leaves[0] * w[0]).sum()    # autograd saves w[0], a view of the record
        return out, graph

    monkeypatch.setattr(sandbox_worker.replay, "run_forward_kept", saving_the_record)
    worker = _worker(tmp_path)
    req, arena = _request(fwd)
    lo, hi = sandbox_worker._arena_range(arena)
    torch.set_grad_enabled(False)
    try:
        answer = worker.forward(req, arena)
    finally:
        torch.set_grad_enabled(True)
    # twice (bench, same-dtype) over the arena, then twice again over the private copy
    assert len(seen) == 4 and all(lo <= p < hi for p in seen[:2]) and not any(lo <= p < hi for p in seen[2:])
    kept = [worker.kept[h][1] for h in answer["kept"]]
    assert all(job.args and not any(lo <= t.untyped_storage().data_ptr() < hi for t in job.args
                                     if isinstance(t, torch.Tensor)) for job in kept)


def test_what_lies_over_the_arena():
    arena = memoryview(bytearray(64))
    over = torch.frombuffer(arena, dtype=torch.float32)
    with sandbox_worker._saved_from(arena) as saved:
        x = torch.randn(16, requires_grad=True)
        (x * torch.randn(16)).sum()
    assert saved == []
    with sandbox_worker._saved_from(arena) as saved:
        (x[:12] * over[4:]).sum()
    assert saved == [True]
    assert sandbox_worker._in_arena(arena, [torch.ones(2), {"a": (over[3:5],)}])
    assert not sandbox_worker._in_arena(arena, [torch.ones(2), over.clone(), 3])


def test_watching_what_autograd_saves_keeps_no_graph_alive():
    """A graph made under the watch is freed with its last reference, as without it (no reference cycle through a
    saved output), and computes the same gradients."""
    import gc
    import weakref

    def run(watched: bool):
        torch.manual_seed(0)
        x = torch.randn(100, requires_grad=True)
        with sandbox_worker._saved_from(memoryview(bytearray(8))) if watched else contextlib.nullcontext():
            y = torch.exp(x)                              # exp and sigmoid save their outputs
            z = torch.sigmoid(y) * x
        z.sum().backward(retain_graph=True)
        refs = weakref.ref(y), weakref.ref(z)
        return refs, x.grad

    gc.disable()
    try:
        (plain, want), (watched, got) = run(False), run(True)
        assert all(r() is None for r in plain + watched)
    finally:
        gc.enable()
    assert torch.equal(got, want)


def test_kept_graphs_let_go_of_outputs_their_backward_does_not_read():
    """Once the answer is written, a worker's kept graphs keep an output's memory only where the backward reads it
    (gpu_server/replay/run.py `release_outputs`): a linear's and a gelu's output go (`nbytes` drops by exactly
    their bytes against the inline replayer's graphs, which keep them), a softmax's and an exp's stay (their nodes
    saved them), and so does a transpose's (a view of its leaf). Every backward on the kept graphs gives the inline
    replayer's gradients bit for bit."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(16, 24)
    x = torch.randn(8, 16, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            h = F.gelu(lin(x))
            y = torch.softmax(h, -1) + torch.exp(h).transpose(0, 1).sum(1)
        (y * torch.arange(24.0)).sum().backward()
    names = {"Functional.linear.0": True, "Functional.gelu.0": True, "Torch.softmax.0": False,
             "Torch.exp.0": False, "Tensor.transpose.0": False}   # True: the output is let go
    inline = InlineReplayer(CPU)
    proc = ProcessReplayer(CPU, SandboxLimits(timeout_s=120), torch.get_num_threads(), 512 * MiB)
    try:
        for name, released in names.items():
            fwd, bwd = to_job(sink.forward(name)), to_job(sink.backward(name))
            want_f = inline.forward(fwd, keep=True, match=True)
            got_f = proc.forward(fwd, keep=True, match=True)
            assert got_f.kept is not None and _same(got_f.bench, want_f.bench) and _same(got_f.same, want_f.same)
            out_bytes = sum(t.nbytes for t in (*want_f.bench, *want_f.same))
            assert got_f.nbytes == want_f.nbytes - (out_bytes if released else 0), name
            want = inline.backward(fwd, bwd, want_f.kept, match=True)
            got = proc.backward(fwd, bwd, got_f.kept, match=True)
            assert _same(got.bench, want.bench) and _same(got.same, want.same), name
        assert proc.replaced == 0
    finally:
        proc.close()
