"""The bench run's memory is bounded before it runs, whatever the record says (issue 21, item 2).

The audit found the meta-device dry run of `gpu_server.replay.run.allocation_check` failing, and then skipped, for sizes
given as tensors (`zeros(tensor(N))`, `repeat`, `new_zeros`, `expand`, `arange`, `repeat_interleave`), for APIs
without a meta kernel (`bincount(minlength)`), for `combinations`, and where the memory is an intermediate
(`mvlgamma`, `ctc_loss`, the float64 im2col of `conv2d`): a 144-byte record grew the server by 2-6 GB. Now sizes
given as tensors are read as numbers, a failing dry run is not replayable except for a documented list of APIs
bounded by their inputs, and the known intermediates are estimated and bounded (gpu_server/replay/memory_bounds.py).
Also:
the intra-op thread count off the wire is capped at the host's usable cores, and only the strided layout passes
the argument check."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu_server.replay import memory_bounds, registry
from gpu_server.replay import run as replay
from gpu_server.replay.run import ReplayError, allocation_check, run_forward, usable_cores
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import apis
from protos import online_check_pb2 as pb
from tests import support

CPU = torch.device("cpu")
L = torch.tensor
HUGE = 1 << 40


def _job(name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, out: Any = None):
    """The call through the real wire encoding and decoder; `out` what the device claims it produced."""
    rec = PendingRecord(name=f"{name}.0", step=0, inputs=snapshot((args, kwargs or {})),
                        output=snapshot(torch.zeros(4) if out is None else out), seq=0)
    return support.to_job(rec)


def _refused(name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, out: Any = None) -> str:
    with pytest.raises(ReplayError) as info:
        allocation_check(_job(name, args, kwargs, out))
    return str(info.value)


def _real(name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    category, api = name.split(".")
    return registry.resolve(category, api)(*args, **(kwargs or {}))


def _passes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
    out = _real(name, args, kwargs)
    allocation_check(_job(name, args, kwargs, out))


# -- sizes given as tensors ------------------------------------------------------------------------------------------
SIZED = [
    ("Torch.zeros", lambda n: ((L(n),), {})),
    ("Torch.zeros", lambda n: (((L(n), 2),), {})),
    ("Torch.full", lambda n: (((L(n),), 1.5), {})),
    ("Torch.arange", lambda n: ((L(n),), {})),
    ("Tensor.repeat", lambda n: ((torch.ones(2), L(n), 1), {})),
    ("Tensor.new_zeros", lambda n: ((torch.ones(2), (L(n),)), {})),
    ("Tensor.expand", lambda n: ((torch.ones(1, 2), L(n), 2), {})),
    ("Torch.repeat_interleave", lambda n: ((torch.ones(3), L(n)), {})),
    ("Torch.repeat_interleave", lambda n: ((L([1, n, 2]),), {})),
]


@pytest.mark.parametrize("name,build", SIZED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SIZED)])
def test_sizes_given_as_tensors_are_bounded(name, build):
    args, kwargs = build(4)
    _passes(name, args, kwargs)                  # an honest size replays
    why = _refused(name, *build(HUGE))            # the same call site with 2**40: refused (not remembered as 4)
    assert why.startswith("not replayable: ") and "would produce" in why, why
    produced = int(why.split("would produce ")[1].split()[0])
    assert produced >= HUGE, why


# -- outputs whose size depends on values ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,args,kwargs", [
    ("Torch.bincount", (L([3, 1]),), {"minlength": 1 << 33}),
    ("Tensor.bincount", (L([3, HUGE]),), {}),
    ("Functional.one_hot", (L([0, 1 << 30]),), {}),
    ("Functional.one_hot", (L([0, 1]), 1 << 30), {}),
    ("Torch.masked_select", (torch.ones(100_000, 1), torch.ones(1, 100_000, dtype=torch.bool)), {}),
    ("Torch.histogram", (torch.randn(8),), {"bins": 1 << 33}),
    ("Torch.cov", (torch.randn(100_000, 1),), {}),
    ("Torch.binomial", (torch.ones(100_000, 1), torch.full((1, 100_000), 0.5)), {}),
    ("Torch.combinations", (torch.randn(2000),), {"r": 4}),
    ("Torch.istft", (torch.stft(torch.randn(64), 16, window=torch.hann_window(16), return_complex=True), 16),
     {"window": torch.hann_window(16), "length": 1 << 33}),
])
def test_outputs_sized_by_values_are_bounded(name, args, kwargs):
    why = _refused(name, args, kwargs)
    assert "would produce" in why, why


def test_value_sized_outputs_that_fit_replay():
    for name, args, kwargs in [("Torch.bincount", (L([3, 1]),), {"minlength": 10}),
                               ("Functional.one_hot", (L([0, 3]),), {}),
                               ("Torch.masked_select", (torch.ones(4, 1), torch.ones(1, 4, dtype=torch.bool)), {}),
                               ("Torch.histogram", (torch.randn(8),), {"bins": 5}),
                               ("Torch.cov", (torch.randn(3, 10),), {}),
                               ("Torch.combinations", (torch.randn(6),), {"r": 3})]:
        _passes(name, args, kwargs)


# -- intermediates ---------------------------------------------------------------------------------------------------
LP = torch.randn(20_000, 1, 3).log_softmax(2)


@pytest.mark.parametrize("name,args,kwargs,out,what", [
    ("Torch.mvlgamma", (torch.full((10,), 1e7),), {"p": 4_000_000}, torch.zeros(10), "mvlgamma's table"),
    ("Tensor.mvlgamma_", (torch.full((10,), 1e7), 4_000_000), {}, torch.zeros(10), "mvlgamma's table"),
    ("Functional.ctc_loss", (LP, torch.ones(1, 10_000, dtype=torch.long), L([20_000]), L([10_000])), {},
     torch.zeros(()), "ctc_loss's alpha and beta tables"),
    ("Functional.conv2d", (torch.ones(1, 1, 128, 128), torch.ones(1, 1, 64, 64)), {"padding": 32},
     torch.zeros(1, 1, 129, 129), "unfolded input (im2col)"),
    ("Functional.conv_transpose2d", (torch.ones(1, 1, 128, 128), torch.ones(1, 1, 64, 64)), {},
     torch.zeros(1, 1, 191, 191), "columns buffer of a transposed convolution"),
    ("Aten.convolution", (torch.ones(1, 1, 128, 128), torch.ones(1, 1, 64, 64), None, [1, 1], [32, 32], [1, 1],
                          False, [0, 0], 1), {}, torch.zeros(1, 1, 129, 129), "unfolded input (im2col)"),
    ("Torch.einsum", ("ij,jk,kl->il", torch.ones(100_000, 1), torch.ones(1, 100_000), torch.ones(100_000, 1)), {},
     torch.zeros(100_000, 1), "einsum's pairwise products"),
    ("Torch.allclose", (torch.ones(100_000, 1), torch.ones(1, 100_000)), {}, torch.zeros(()),
     "allclose's comparison"),
    ("Functional.scaled_dot_product_attention", (torch.ones(1, 1, 20_000, 1),) * 3, {"dropout_p": 0.1},
     torch.zeros(1, 1, 20_000, 1), "attention scores of scaled_dot_product_attention"),
    ("NPU.npu_fusion_attention", (torch.ones(1, 20_000, 2),) * 3 + (2, "BSH"), {},
     (torch.zeros(1, 20_000, 2), torch.zeros(1, 2, 20_000, 8), torch.zeros(1, 2, 20_000, 8)),
     "attention scores of npu_fusion_attention"),
    ("Functional.gaussian_nll_loss", (torch.ones(100_000, 1), torch.ones(1, 100_000), torch.ones(1, 100_000)), {},
     torch.zeros(()), "gaussian_nll_loss terms of the broadcast inputs"),
])
def test_large_intermediates_are_bounded(name, args, kwargs, out, what):
    why = _refused(name, args, kwargs, out)   # `out`: the outputs a device would have produced, so only the
    assert "would need about" in why and what in why and "allowed for a record of" in why, why   # buffer is over


def test_combinations_masks_are_counted_beyond_its_output():
    nbytes, what = memory_bounds.intermediate_bytes("Torch", "combinations", (torch.ones(200),), {"r": 4})
    assert nbytes == 2 * 200 ** 4 and "200**4" in what
    assert memory_bounds.intermediate_bytes("Torch", "combinations", (torch.ones(10),), {"r": 10 ** 6})[0] >= 1 << 62


def test_intermediates_of_honest_calls_fit():
    torch.manual_seed(0)
    lp = torch.randn(50, 4, 20).log_softmax(2)
    for name, args, kwargs in [
        ("Torch.mvlgamma", (torch.full((10,), 5.0),), {"p": 3}),
        ("Functional.ctc_loss", (lp, torch.randint(1, 20, (4, 30)), L([50, 48, 40, 30]), L([30, 20, 10, 5])), {}),
        ("Functional.conv2d", (torch.randn(8, 64, 28, 28), torch.randn(64, 64, 3, 3)), {"padding": 1}),
        ("Functional.conv1d", (torch.randn(2, 3, 100), torch.randn(4, 3, 7)), {"dilation": 2}),
        ("Functional.conv_transpose2d", (torch.randn(2, 8, 8, 8), torch.randn(8, 4, 4, 4)), {"stride": 2}),
        ("Torch.einsum", ("bij,bjk->bik", torch.randn(4, 16, 32), torch.randn(4, 32, 8)), {}),
        ("Torch.einsum", ("ij,jk,kl->il", torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)), {}),
        ("Torch.einsum", ("...ij,...jk,...kl", torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(2, 5, 6)), {}),
        ("Torch.allclose", (torch.randn(64, 64), torch.randn(64, 64)), {}),
        ("Functional.scaled_dot_product_attention", (torch.randn(2, 4, 64, 16),) * 3, {"dropout_p": 0.1}),
    ]:
        _passes(name, args, kwargs)
    est = memory_bounds.intermediate_bytes("Functional", "conv2d", (torch.ones(8, 64, 28, 28),
                                                                    torch.ones(64, 64, 3, 3)), {"padding": 1})
    assert est is not None and est[0] == 8 * (64 * 9) * (28 * 28) * 8, est   # N x C*kh*kw x out positions, float64


def test_the_einsum_estimate_follows_torchs_left_to_right_products():
    n = 1000
    ops = (torch.ones(n, 1), torch.ones(1, n), torch.ones(n, 1))
    nbytes, _ = memory_bounds.intermediate_bytes("Torch", "einsum", ("ij,jk,kl->il", *ops), {})
    assert nbytes == n * n * 8
    # the sublist format and aten's explicit path name the same contraction
    assert memory_bounds.intermediate_bytes("Torch", "einsum", (ops[0], [0, 1], ops[1], [1, 2], ops[2], [2, 3],
                                                                 [0, 3]), {})[0] == n * n * 8
    smart = memory_bounds.intermediate_bytes("Aten", "einsum", ("ij,jk,kl->il", list(ops)), {"path": [1, 2, 0, 1]})
    assert smart[0] == n * 8   # (1,n)(n,1) first: a 1x1 product, then (n,1)


# -- a failing dry run ---------------------------------------------------------------------------------------------
def test_a_failing_dry_run_is_not_replayable_unless_the_api_is_bounded_by_its_inputs():
    why = _refused("Torch.mm", (torch.ones(2, 3), torch.ones(4, 5)))
    assert "failed its dry run on the meta device" in why and "bounded by their inputs" in why, why
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    for name, args in [("Torch.nonzero", (x,)), ("Torch.unique", (x,)), ("Tensor.masked_select", (x, x > 0)),
                       ("Tensor.__getitem__", (x, x > 0)), ("Torch.equal", (x, x)), ("Tensor.cpu", (x,))]:
        category, api = name.split(".")
        assert isinstance(replay._meta_elements(_job(name, args)), str) or api not in memory_bounds.BOUNDED_BY_INPUTS
        _passes(name, args)


def test_the_documented_lists_name_allowlisted_apis():
    listed = memory_bounds.BOUNDED_BY_INPUTS | set(memory_bounds.OUTPUT_ESTIMATES) | set(
        memory_bounds.INTERMEDIATE_ESTIMATES)
    unknown = [n for n in listed if not any(n in names for names in apis.ALLOWLIST.values())]
    assert not unknown, unknown
    # each name exempted from the dry run really has none on this torch (else it needs no exemption)
    samples = {"nonzero": (torch.ones(3),), "argwhere": (torch.ones(3),), "where": (torch.ones(3) > 0,),
               "unique": (torch.ones(3),), "unique_consecutive": (torch.ones(3),), "equal": (torch.ones(3),) * 2,
               "geqrf": (torch.ones(3, 3),), "linalg_lstsq": (torch.ones(3, 2), torch.ones(3, 1)),
               "tensor_split": (torch.ones(6), L([1, 4]))}
    for api, args in samples.items():
        category = "Torch"
        dry = replay._meta_elements(_job(f"{category}.{api}", args))
        assert isinstance(dry, str), (api, dry)


def test_a_mask_index_is_dry_run_with_the_positions_it_selects():
    x = torch.arange(12.0).reshape(3, 4)
    mask = x > 5
    assert replay._meta_elements(_job("Tensor.__getitem__", (x, mask))) == int(mask.sum())
    assert replay._meta_elements(_job("Tensor.__getitem__", (x, (mask[:, 0], slice(1, 3))))) == 2


# -- common calls are not refused ------------------------------------------------------------------------------------
def _common():
    torch.manual_seed(0)
    r = torch.randn
    x4 = r(2, 3, 8, 8)
    lp = r(12, 2, 5).log_softmax(2)
    mp, mpi = F.max_pool2d(x4, 2, return_indices=True)
    lstm = [r(16, 3), r(16, 4), r(16), r(16)]
    yield "Functional.ctc_loss", (lp, torch.randint(1, 5, (2, 4)), L([12, 10]), L([4, 3])), {}
    yield "Torch.segment_reduce", (r(6), "sum"), {"lengths": L([2, 4])}
    yield "Functional.embedding_bag", (L([0, 2, 4, 1]), r(5, 3), L([0, 2])), {"mode": "sum"}
    yield "Aten.max_pool2d_with_indices_backward", (r(*mp.shape), x4, [2, 2], [2, 2], [0, 0], [1, 1], False, mpi), {}
    yield "Functional.max_unpool2d", (mp, mpi, 2), {}
    yield "Torch.lstm", (r(6, 3), L([2, 2, 1, 1]), [torch.zeros(1, 2, 4)] * 2, lstm, True, 1, 0.0, False, False), {}
    yield "Torch.lstm", (r(5, 2, 3), [torch.zeros(1, 2, 4)] * 2, lstm, True, 1, 0.0, False, False, False), {}
    yield "Tensor.__setitem__", (r(4, 5), r(4, 5) > 0, 0.0), {}
    yield "Torch.index_put", (r(4, 5), (r(4) > 0,), r(1, 5)), {}
    yield "Functional.cross_entropy", (r(2, 5, 4, 4), torch.randint(0, 5, (2, 4, 4))), {}
    yield "Torch.repeat_interleave", (r(3, 2), L([1, 2, 3])), {"dim": 0}
    yield "Functional.interpolate", (x4,), {"scale_factor": 2, "mode": "bilinear"}
    yield "Functional.scaled_dot_product_attention", (r(2, 3, 4, 8), r(2, 3, 4, 8), r(2, 3, 4, 8)), {}
    yield "Functional.fold", (r(2, 27, 36), (8, 8), 3), {}
    yield "Torch.stft", (r(64), 16), {"return_complex": True, "window": torch.hann_window(16)}
    yield "Torch.linalg_eig", (r(3, 3),), {}
    yield "Torch.histc", (r(10),), {"bins": 5}
    yield "Torch.tril_indices", (4, 5), {}
    yield "Torch.nonzero_static", (r(4) > 0,), {"size": 4}
    yield "Torch.multinomial", (r(4).abs(), 2), {}
    yield "Torch.binomial", (torch.full((3,), 5.0), torch.full((3,), 0.5)), {}
    yield "Torch._foreach_norm", ([r(3), r(4)],), {}
    yield "Functional.grouped_mm", (torch.ones(8, 16, dtype=torch.bfloat16),
                                    torch.ones(2, 8, 16, dtype=torch.bfloat16).transpose(-2, -1)), \
        {"offs": L([4, 8], dtype=torch.int32)}
    yield "Torch.istft", (torch.stft(r(64), 16, window=torch.hann_window(16), return_complex=True), 16), \
        {"window": torch.hann_window(16)}
    yield "Functional.gaussian_nll_loss", (r(3, 4), r(3, 4), r(3, 4).abs()), {}
    yield "Torch._fused_sgd_", ([r(3)], [r(3)], []), {"weight_decay": 0.0, "momentum": 0.0, "lr": 0.1, "dampening": 0.0,
                                                      "nesterov": False, "maximize": False, "is_first_step": True}
    yield "Torch.mul", (r(3), L(2.0)), {}
    yield "Tensor.add_", (r(3), L(2)), {}


def test_common_training_calls_pass_the_bounds():
    for name, args, kwargs in _common():
        category, api = name.split(".")
        out = _real(name, tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), kwargs)
        job = _job(name, args, kwargs, args[0] if out is None else out)
        assert registry.replayable(category, api, job.args, job.kwargs) is None, name
        replay.bounds_check(job)
        allocation_check(job)


# -- threads and layouts ---------------------------------------------------------------------------------------------
def test_the_intra_op_thread_count_off_the_wire_is_capped_at_the_usable_cores(monkeypatch):
    job = _job("Torch.abs", (torch.randn(3),), {}, torch.zeros(3))
    job.intra_op_threads = 1024                     # what a hostile record may say (intake passes up to 1,024)
    seen = []
    monkeypatch.setattr(replay, "resolve", lambda category, api: lambda t: seen.append(torch.get_num_threads()) or
                        t.abs())
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_forward(job, CPU, bench=False)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)
    cores = usable_cores()
    assert cores == len(os.sched_getaffinity(0))
    assert seen == [min(1024, cores)] and after == 1, (seen, cores)


def test_only_the_strided_layout_is_an_argument():
    for layout in (torch.sparse_coo, torch.sparse_csr, torch._mkldnn):
        why = registry.replayable("Torch", "zeros", ((2, 2),), {"layout": layout})
        assert why and why.startswith("not replayable: ") and "only torch.strided" in why, why
    assert registry.replayable("Torch", "zeros", ((2, 2),), {"layout": torch.strided}) is None
    job = _job("Torch.zeros", ((2, 2),), {"layout": torch.sparse_coo})   # through the wire
    assert "only torch.strided" in registry.replayable(job.category, job.api, job.args, job.kwargs)


# -- through a real server -------------------------------------------------------------------------------------------
def test_greedy_records_through_a_real_server_are_skip(tmp_path):
    """Small records asking for gigabytes (each in its own way the dry run used to miss) are reported SKIP with the
    reason; an honest record beside them passes, a sparse layout is refused at intake."""
    greedy = [
        ("Torch.zeros", ((L(HUGE),),), {}, "would produce"),
        ("Tensor.repeat", (torch.ones(2), L(1 << 20), L(1 << 20)), {}, "would produce"),
        ("Torch.bincount", (L([3]),), {"minlength": 1 << 27}, "would produce"),
        ("Torch.repeat_interleave", (L([1 << 30, 1]),), {}, "would produce"),
        ("Torch.mvlgamma", (torch.full((64,), 1e7),), {"p": 2_000_000}, "mvlgamma's table"),
        ("Torch.combinations", (torch.randn(150),), {"r": 4}, "would produce"),
        ("Functional.conv2d", (torch.ones(1, 1, 128, 128), torch.ones(1, 1, 64, 64)), {"padding": 32},
         "unfolded input (im2col)"),
        ("Torch.einsum", ("ij,jk,kl->il", torch.ones(12_000, 1), torch.ones(1, 12_000), torch.ones(12_000, 1)), {},
         "einsum's pairwise products"),
    ]
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    honest = ("Functional.linear", (x, w), {}, F.linear(x, w))
    sparse = ("Torch.zeros", ((2, 2),), {"layout": torch.sparse_coo}, torch.zeros(2, 2))
    msgs = [pb.Frame(hello=pb.Hello(run_id="greedy", rank=0)).SerializeToString()]
    calls = [(n, a, k, torch.zeros(4)) for n, a, k, _ in greedy] + [honest, sparse]
    for seq, (name, args, kwargs, out) in enumerate(calls):
        rec = PendingRecord(name=f"{name}.{seq}", step=0, inputs=snapshot((args, kwargs)), output=snapshot(out),
                            seq=seq)
        enc = encode_record(rec, "greedy", 0)
        msgs += list(enc.wire_frames(1 << 20))
    with support.Server(str(tmp_path)) as srv:
        acks = support.stream_acks(srv.port, msgs, lambda acks: len(acks) >= len(calls))
        code = srv.stop()
        log = srv.log()
    assert [a.status for a in acks] == [pb.Ack.ACCEPTED] * (len(greedy) + 1) + [pb.Ack.REJECTED], acks
    assert "only torch.strided" in acks[-1].reason
    assert code == 0 and "Traceback" not in log, log[-3000:]
    rows = support.by_name(support.read_csv(srv.out, "accuracy_checking_result"))
    for seq, (name, _, _, reason) in enumerate(greedy):
        row = rows[f"{name}.{seq}"]
        assert row["Forward Test Success"] == "SKIP" and "not replayable" in row["Message"], row
        assert reason in row["Message"], row
    assert rows[f"Functional.linear.{len(greedy)}"]["Forward Test Success"] == "pass"
