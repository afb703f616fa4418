"""The server's fast paths give exactly what the plain paths give (issue 13): the metrics' finite pass (as a
compiled one-pass kernel and as tiled torch ops) against the general per-chunk pass, bit-identical outputs analysed
once, and a backward replay on the forward's kept graph against a full backward replay."""
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

from gpu_server.checking import pooled, pooled_kernel
from gpu_server.checking.checker import Checker
from gpu_server.checking.pending import PendingCalls
from gpu_server.checking.workers import Worker
from gpu_server.judging import metric_kernel, metrics
from gpu_server.replay import run as replay
from gpu_server.replay.run import backward_from, run_backward, run_forward, run_forward_kept
from gpu_server.reports.rank_reports import Reports
from gpu_server.reports.summary import Summary
from tests.support import capture, to_job

CPU = torch.device("cpu")


def _general(bench, device, chunk_elements=None):
    """The metrics through `_Accumulator.add` only (the path for outputs with inf/NaN or huge values)."""
    saved = metrics._FAST_LIMIT
    metrics._FAST_LIMIT = 0.0
    try:
        return metrics.analyse(bench, device, chunk_elements)
    finally:
        metrics._FAST_LIMIT = saved


def _cases():
    g = torch.Generator().manual_seed(0)
    n = 3 * metrics._TILE + 17   # several tiles and a short one
    x = torch.randn(n, generator=g)
    x[::7] = 0
    x[1::11] *= 1e-7             # small values
    b = x.double()
    noisy = (b + torch.randn(n, dtype=torch.float64, generator=g) * 1e-6 * b.abs()).float()
    part = x.clone()
    part[metrics._TILE:2 * metrics._TILE] = noisy[metrics._TILE:2 * metrics._TILE]   # exact tiles and one that is not
    bigger = x.clone()
    bigger[-1] = 8 * x.abs().max()   # exact tiles, but another max |x| than the bench's
    h = torch.randn(n, generator=g).half()
    hb = h.float() + torch.randn(n, generator=g) * 1e-3
    bf = (b * 3).to(torch.bfloat16)
    tiny_b = b * 1e-310          # subnormal float64 bench values: the ULP exponent is clamped
    return [("noisy", b, noisy), ("exact", b, x.clone()), ("partly exact", b, part), ("other max", b, bigger),
            ("float16", hb, h), ("float16 exact", h.float(), h.clone()), ("bfloat16", (b * 3).float(), bf),
            ("subnormal bench", tiny_b, (tiny_b * 2).float()), ("zero bench", torch.zeros_like(b), noisy),
            ("float64 device", b, b + torch.randn(n, dtype=torch.float64, generator=g) * 1e-12 * b.abs()),
            ("tiny", b[:5], noisy[:5])]


@pytest.fixture(params=["compiled", "torch ops"])
def finite_pass(request, monkeypatch):
    """Each finite pass in turn: metric_kernel's compiled one (numba; the setup installs it) and the torch ops."""
    if request.param == "compiled":
        pytest.importorskip("numba")
        assert metric_kernel.kernel() is not None
        monkeypatch.setattr(metrics, "KERNEL_MIN_ELEMENTS", 1)
    else:
        monkeypatch.setattr(metrics, "USE_KERNEL", False)
    return request.param


@pytest.mark.parametrize("name,bench,device", _cases(), ids=[c[0] for c in _cases()])
def test_finite_pass_equals_the_general_pass(name, bench, device, finite_pass):
    fast, slow = metrics.analyse(bench, device), _general(bench, device)
    assert fast.metrics == slow.metrics, name            # every cell, bit for bit
    assert dict(fast.metrics.counts) == dict(slow.metrics.counts)
    assert fast.cosine == slow.cosine


def test_small_outputs_take_the_compiled_pass_once_it_is_loaded(monkeypatch):
    """An output under KERNEL_MIN_ELEMENTS takes the torch ops while the compiled pass is not loaded (nothing is
    loaded for it), and the compiled pass once a larger output, or SMALL_BEFORE_LOADING smaller ones, loaded it:
    the same metrics, bit for bit, either way."""
    pytest.importorskip("numba")
    real = metric_kernel.kernel()
    assert real is not None
    calls = []

    def counting(*args):
        calls.append(1)
        return real(*args)

    g = torch.Generator().manual_seed(1)
    b = torch.randn(300, dtype=torch.float64, generator=g)
    d = (b + torch.randn(300, dtype=torch.float64, generator=g) * 1e-6).float()
    big_b = torch.randn(metrics.KERNEL_MIN_ELEMENTS, dtype=torch.float64, generator=g)
    monkeypatch.setattr(metrics, "USE_KERNEL", False)
    want = metrics.analyse(b, d).metrics
    monkeypatch.setattr(metrics, "USE_KERNEL", True)

    def unloaded(before_loading: int) -> None:
        monkeypatch.setattr(metric_kernel.KERNEL, "_kernel", None)
        monkeypatch.setattr(metric_kernel.KERNEL, "_tried", False)
        monkeypatch.setattr(metric_kernel.KERNEL, "build", lambda: counting)
        monkeypatch.setattr(metrics, "SMALL_BEFORE_LOADING", before_loading)
        monkeypatch.setattr(metrics, "_small_seen", __import__("itertools").count())
        calls.clear()

    unloaded(3)
    for _ in range(3):
        assert metrics.analyse(b, d).metrics == want
    assert metric_kernel.loaded() is None and not calls   # a short run: nothing loaded, torch ops
    assert metrics.analyse(b, d).metrics == want          # the fourth small output loads it and takes it
    assert metric_kernel.loaded() is counting and calls
    unloaded(1000)
    metrics.analyse(big_b, big_b.float())                 # a large output loads it ...
    calls.clear()
    assert metrics.analyse(b, d).metrics == want          # ... and a small one takes it from then on
    assert calls


@pytest.mark.parametrize("chunk", [2 * metrics._TILE + 5, metrics._TILE - 3], ids=["tiles and a part", "short"])
def test_finite_pass_equals_the_general_pass_over_several_chunks(chunk, finite_pass):
    """Chunks that do not end on a tile: each chunk's tiles start at its own start, in every path."""
    for name, bench, device in _cases()[:5]:
        fast, slow = metrics.analyse(bench, device, chunk), _general(bench, device, chunk)
        assert fast.metrics == slow.metrics, name
        assert fast.cosine == slow.cosine


def test_the_metrics_do_not_depend_on_torchs_thread_count(finite_pass):
    """A tile is at most 32 Ki elements, which torch sums on one thread whatever its thread count: the same cells with
    one thread (one CPU worker's server on one core) and two. (Sums over a whole chunk differed: a 3 Mi-element
    output's cosine and mean relative error, between 1 and 2 threads.)"""
    _, bench, device = _cases()[0]
    bench, device = bench.repeat(2), device.repeat(2)     # 6 tiles and more: above torch's grain of 32 Ki elements
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((metrics.analyse(bench, device), _general(bench, device)))
    finally:
        torch.set_num_threads(threads)
    (fast1, slow1), (fast2, slow2) = results
    assert fast1.metrics == fast2.metrics == slow1.metrics == slow2.metrics
    assert fast1.cosine == fast2.cosine


def test_a_chunks_sums_are_its_tiles_sums_added_in_order():
    values = torch.randn(2 * metrics._TILE + 9, dtype=torch.float64) * 1e3
    t = metrics._TILE
    want = values[:t].sum() + values[t:2 * t].sum() + values[2 * t:].sum()
    assert metrics._tiled_sum(values).item() == want.item()
    assert metrics._tiled_sum(values[:5]).item() == values[:5].sum().item()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_tiles_rows_summed_together_are_each_row_summed_alone(threads):
    """The compiled pass sums a tile's summands, a row each of one buffer, with one sum over the rows' first m
    elements: each row's value must be the bits torch gives that row's elements summed alone (as the torch ops and
    _tiled_sum sum them), for any length up to a tile and any thread count."""
    g = torch.Generator().manual_seed(3)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for trial in range(120):
            rows = 1 + 5 * (1 + trial % 3)
            grid = torch.randn(rows, metrics._TILE, dtype=torch.float64, generator=g)
            if trial % 2:
                grid = grid.abs() * 10.0 ** (trial % 600 - 300)
            m = [1, 3, 7, 8, 9, 15, 17, 63, 65, 4095, 4097, metrics._TILE][trial % 12] if trial < 60 else \
                int(torch.randint(1, metrics._TILE + 1, (), generator=g))
            together = grid[:, :m].sum(1).tolist()
            alone = [grid[r][:m].clone().sum().item() for r in range(rows)]
            assert together == alone, (trial, m)
    finally:
        torch.set_num_threads(saved)


def test_the_compiled_pass_runs_when_numba_is_installed(monkeypatch):
    pytest.importorskip("numba")
    calls = []
    original = metrics._compiled_tiles
    monkeypatch.setattr(metrics, "_compiled_tiles", lambda *a: calls.append(1) or original(*a))
    _, bench, device = _cases()[0]
    metrics.analyse(bench, device)
    assert calls


def test_bit_identical_outputs_are_analysed_once_with_the_same_result():
    _, bench, device = _cases()[0]
    twin = device.clone()
    calls = []
    original = metrics._analyse_floats

    def spy(b, devices, chunk):
        calls.append(len(devices))
        return original(b, devices, chunk)

    metrics._analyse_floats = spy
    try:
        with metrics.shared():
            metrics.prefetch(bench, [device, twin])
            a, b = metrics.analyse(bench, device), metrics.analyse(bench, twin)
    finally:
        metrics._analyse_floats = original
    assert calls == [1]                   # one output analysed, the twin shares its result
    assert a.metrics == b.metrics == metrics.analyse(bench, twin).metrics


@pytest.mark.parametrize("name", ["Functional.linear.0", "Functional.layer_norm.0", "Tensor.mul_.0"])
def test_backward_on_the_kept_forward_equals_a_full_backward_replay(name):
    ln = torch.nn.LayerNorm(16)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            y = lin(ln(x))
            y = (y + 1.0).mul_(2.0)
        (y * torch.arange(16.0)).sum().backward()
    fwd, bwd = to_job(sink.forward(name)), to_job(sink.backward(name))
    for bench in (True, False):
        out, kept = run_forward_kept(fwd, CPU, bench=bench)
        assert kept is not None
        plain = run_forward(fwd, CPU, bench=bench)
        assert torch.equal(out.detach(), plain)
        got, want = backward_from(kept, fwd, bwd, CPU), run_backward(fwd, bwd, CPU, bench=bench)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert (g is None and w is None) or (g.dtype == w.dtype and torch.equal(g, w))


def test_a_forward_that_cannot_run_with_autograd_is_replayed_as_before_without_a_graph():
    x = torch.randn(6)
    with capture() as (mode, sink):
        with mode:
            torch.add(x, 1.0)
    job = to_job(sink.forward("Torch.add.0"))     # nothing required grad: no graph to keep
    out, kept = run_forward_kept(job, CPU, bench=True)
    assert kept is None and torch.equal(out, run_forward(job, CPU, bench=True))


def _worker(tmp: str, pending: PendingCalls) -> Worker:
    """One server worker, in this thread: PendingCalls decides, the Checker computes, Reports writes."""
    summary = Summary()
    return Worker(Checker(CPU, summary), Reports(tmp, "ts", summary.add_files), pending)


def _check_all(sink, graph_budget: int, tmp: str) -> tuple[dict[str, str], int]:
    """Every record through a real server worker; the report files' text and how many full backward replays ran."""
    worker = _worker(tmp, PendingCalls(1 << 30, graph_budget=graph_budget))
    replays = []
    original = replay.run_backward

    def counting(*args, **kwargs):
        replays.append(1)
        return original(*args, **kwargs)

    import gpu_server.replay.sandbox as sandbox_module  # the in-process replayer the Checker uses by default
    sandbox_module.run_backward = counting
    try:
        torch.set_grad_enabled(False)   # as in the worker threads
        for seq, rec in enumerate(sink):
            rec.seq = seq
            worker.check(to_job(rec))
        worker.close()
    finally:
        sandbox_module.run_backward = original
        torch.set_grad_enabled(True)
    files = {}
    for f in sorted(os.listdir(tmp)):
        if f.endswith(".csv"):
            with open(os.path.join(tmp, f), encoding="utf-8") as fh:
                files[f] = fh.read()
    return files, len(replays)


def test_checker_rows_are_the_same_with_and_without_kept_graphs():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with capture() as (mode, sink):
        with mode:
            loss = F.cross_entropy(model(x), torch.arange(8) % 4)
        loss.backward()
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        kept, kept_replays = _check_all(sink, 1 << 30, a)
        plain, plain_replays = _check_all(sink, 0, b)
    backward_calls = sum(1 for r in sink if r.direction == 2)
    assert backward_calls >= 4
    # every backward ran on its kept graphs (bench and same-dtype); without them, two full replays each
    assert kept_replays == 0 and plain_replays == 2 * backward_calls
    assert kept == plain and len(kept) == 4


def test_the_summary_counts_backward_replays_on_kept_graphs_and_graphs_dropped():
    """summary.json's memory section (and the console summary when a graph was dropped): how many backward replays
    ran on their forward's kept graphs, how many replayed the forward again, and how many kept graphs the budget
    dropped before their backward came."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    with capture() as (mode, sink):
        with mode:
            loss = F.cross_entropy(model(torch.randn(8, 16)), torch.arange(8) % 4)
        loss.backward()
    backward_calls = sum(1 for r in sink if r.direction == 2)

    def counts(budget: int) -> tuple[dict, str]:
        with tempfile.TemporaryDirectory() as tmp:
            pending = PendingCalls(1 << 30, graph_budget=budget)
            worker = _worker(tmp, pending)
            torch.set_grad_enabled(False)
            try:
                for seq, rec in enumerate(sink):
                    rec.seq = seq
                    worker.check(to_job(rec))
            finally:
                torch.set_grad_enabled(True)
                worker.close()
            summary = worker.checker.summary
            summary.set_graphs_dropped(pending.graphs_dropped)
            memory = summary.as_dict()["memory"]
            return {k: memory[k] for k in ("backward_replays_on_kept_graphs", "backward_replays_forward_again",
                                           "kept_graphs_dropped_for_memory")}, summary.human()

    kept, text = counts(1 << 30)
    assert kept == {"backward_replays_on_kept_graphs": backward_calls, "backward_replays_forward_again": 0,
                    "kept_graphs_dropped_for_memory": 0}
    assert "ran their forward again" not in text
    never, text = counts(0)   # nothing is kept: nothing is dropped either
    assert never == {"backward_replays_on_kept_graphs": 0, "backward_replays_forward_again": backward_calls,
                     "kept_graphs_dropped_for_memory": 0}
    assert "ran their forward again" not in text
    dropped, text = counts(1)   # every graph is larger than the budget: kept, then dropped at once
    assert dropped["backward_replays_forward_again"] == backward_calls
    assert dropped["kept_graphs_dropped_for_memory"] >= backward_calls
    assert (f"backward replays that ran their forward again: {backward_calls} of {backward_calls} "
            f"({dropped['kept_graphs_dropped_for_memory']} kept graphs dropped") in text


def test_kept_graphs_stay_within_their_budget_oldest_dropped_first():
    lin1, lin2 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with capture() as (mode, sink):
        with mode:
            y = lin2(lin1(x))
        y.sum().backward()
    first, second = to_job(sink.forward("Functional.linear.0")), to_job(sink.forward("Functional.linear.1"))

    def kept(budget: int, *jobs) -> tuple[list[str], int]:
        """The calls whose graphs a checker keeps after these forward jobs, and their bytes."""
        with tempfile.TemporaryDirectory() as tmp:
            pending = PendingCalls(1 << 30, graph_budget=budget)
            worker = _worker(tmp, pending)
            owner = worker.checker.replayer
            torch.set_grad_enabled(False)
            try:
                for seq, job in enumerate(jobs):
                    job.seq = seq
                    worker.check(job)
                return [k.name for k in pending._graphs.get(owner, {})], pending._graph_bytes.get(owner, 0)
            finally:
                torch.set_grad_enabled(True)
                worker.close()

    names, size = kept(1 << 30, first)
    assert size > 0 and names == [first.name]
    names, held = kept(size + size // 2, first, second)   # room for one: the older call's graphs are dropped
    assert names == [second.name] and held <= size + size // 2
    assert kept(1, first) == ([], 0)   # larger than the budget: not kept at all


def _pooled_cases():
    g = torch.Generator().manual_seed(0)
    for dev_dt, bench_dt in ((torch.float32, torch.float64), (torch.bfloat16, torch.float32),
                             (torch.float16, torch.float32)):
        for shape in ((5,), (4, 64), (3, 7, 33), (300, 200)):
            b = torch.randn(shape, dtype=torch.float64, generator=g).to(bench_dt)
            b.view(-1)[::7] *= 1e3
            d = (b.double() * (1 + torch.randn(shape, dtype=torch.float64, generator=g) * 1e-3)).to(dev_dt)
            s = b.to(dev_dt)
            if b.numel() > 10:   # not finite, zero and subnormal bench values, a gross error (clipped)
                d.view(-1)[1], d.view(-1)[2], s.view(-1)[6] = float("inf"), float("nan"), float("-inf")
                b.view(-1)[3], b.view(-1)[4] = 0.0, 1e-30
                d.view(-1)[5] = -d.view(-1)[5] * 50
            yield f"{str(dev_dt)[6:]} {shape}", b, d, s


@pytest.mark.parametrize("tolerance", [pooled.SPREAD_TOLERANCE, 2.3])
@pytest.mark.parametrize("max_elements", [pooled.MAX_ELEMENTS, 100])
def test_pooled_compiled_pass_equals_the_torch_ops(tolerance, max_elements, monkeypatch):
    """gpu_server/checking/pooled_kernel.py's one pass gives every pooled sum bit for bit as the torch ops do: float32
    devices (float64 work), bfloat16 and float16 (float32 work), rows, subsampling, a tolerance that is not a power of
    two, inf/NaN, zero and subnormal bench values, a clipped gross error."""
    pytest.importorskip("numba")
    assert metric_kernel.kernel() is not None and pooled_kernel.kernel() is not None
    for name, b, d, s in _pooled_cases():
        monkeypatch.setattr(pooled, "USE_KERNEL", True)
        assert pooled._kernel() is not None
        compiled = pooled._terms(b, d, s, pooled.CLIP_ULP, tolerance, max_elements)
        monkeypatch.setattr(pooled, "USE_KERNEL", False)
        assert pooled._kernel() is None
        assert compiled == pooled._terms(b, d, s, pooled.CLIP_ULP, tolerance, max_elements), name


def test_pooled_compiled_pass_waits_for_the_metrics_one(monkeypatch):
    """The pooled errors take their compiled pass only once the metrics' one is loaded (a short run loads none)."""
    pytest.importorskip("numba")
    monkeypatch.setattr(metric_kernel.KERNEL, "_kernel", None)
    assert pooled._kernel() is None
    monkeypatch.setattr(metric_kernel.KERNEL, "_kernel", metric_kernel.KERNEL.build())
    assert pooled._kernel() is pooled_kernel.kernel() is not None
