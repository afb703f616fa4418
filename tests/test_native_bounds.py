"""Index arguments that native kernels dereference are checked against what they index (issue 21, item 2).

An audit found allowlisted APIs whose kernels take an index without a bound: one record with an index of 2**40 to
`Aten.max_pool2d_with_indices_backward` killed the server with SIGSEGV, an index of 100,000 to
`Aten.embedding_dense_backward` wrote past a heap buffer. gpu_server/replay/native_bounds.py checks every index-like
argument of every allowlisted API that takes one (found by schema: the walk below fails for one without a rule):
an out-of-range index makes the record not replayable, with the argument, its value and the bound in the reason;
an in-range record still replays. Records go through the real wire encoding and decoder, as the intake sees them,
and through a real server process."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from gpu_server.replay import registry
from gpu_server.replay.native_bounds import RULES, index_problem
from gpu_server.replay.run import ReplayError, run_forward
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import apis
from protos import online_check_pb2 as pb
from tests import support

CPU = torch.device("cpu")
BIG = 1 << 40
L = torch.tensor


def _pool() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4, 4)
    out, idx = F.max_pool2d(x, 2, return_indices=True)
    return x, out, idx


def _with(t: torch.Tensor, v: int, at: int = -1) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[at] = v
    return t


def _lu() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.linalg.lu_factor(torch.randn(3, 3, dtype=torch.float64))


def _ldl() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    a = torch.randn(3, 3, dtype=torch.float64)
    return torch.linalg.ldl_factor(a @ a.T + 3 * torch.eye(3, dtype=torch.float64))


R45 = torch.arange(20.0).reshape(4, 5)
LP = torch.randn(12, 2, 5, generator=torch.Generator().manual_seed(3)).log_softmax(2)
LSTM = [torch.randn(16, 3), torch.randn(16, 4), torch.randn(16), torch.randn(16)]

# (name, argument, good value, [lo, hi), build(v) -> (args, kwargs)): `v` goes into the index argument
Case = tuple[str, str, int, int, int, Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]]
CASES: list[Case] = [
    # the five of the audit
    ("Aten.max_pool2d_with_indices_backward", "indices", 5, 0, 16,
     lambda v: ((_pool()[1] * 0 + 1, _pool()[0], [2, 2], [2, 2], [0, 0], [1, 1], False, _with(_pool()[2], v)), {})),
    ("Aten.embedding_dense_backward", "indices", 4, 0, 5,
     lambda v: ((torch.ones(3, 4), L([0, 1, v]), 5, -1, False), {})),
    ("Aten.embedding_backward", "indices", 4, 0, 5,
     lambda v: ((torch.ones(3, 4), L([0, 1, v]), 5, -1, True, False), {})),
    ("Torch.segment_reduce", "offsets", 6, 0, 7,
     lambda v: ((torch.arange(6.0), "sum"), {"offsets": L([0, 2, v]), "unsafe": True})),
    ("Functional.ctc_loss", "targets", 3, 0, 5,
     lambda v: ((LP, L([[1, 2, v, 4], [1, 1, 2, 0]]), L([12, 10]), L([4, 3])), {})),
    # gather / scatter / index_*
    ("Torch.gather", "index", 4, 0, 5, lambda v: ((R45, 1, _with(torch.zeros(4, 2, dtype=torch.long), v)), {})),
    ("Tensor.gather", "index", 3, 0, 4, lambda v: ((R45, 0, _with(torch.zeros(2, 5, dtype=torch.long), v)), {})),
    ("Torch.scatter", "index", 4, 0, 5,
     lambda v: ((R45, 1, _with(torch.zeros(4, 1, dtype=torch.long), v), torch.ones(4, 1)), {})),
    ("Tensor.scatter_", "index", 4, 0, 5,
     lambda v: ((R45.clone(), 1, _with(torch.zeros(4, 1, dtype=torch.long), v), 2.0), {})),
    ("Torch.scatter_add", "index", 4, 0, 5,
     lambda v: ((R45, 1, _with(torch.zeros(4, 1, dtype=torch.long), v), torch.ones(4, 1)), {})),
    ("Tensor.scatter_reduce_", "index", 3, 0, 4,
     lambda v: ((R45.clone(), 0, _with(torch.zeros(1, 5, dtype=torch.long), v), torch.ones(1, 5), "amax"), {})),
    ("Torch.index_select", "index", 3, 0, 4, lambda v: ((R45, 0, L([0, v])), {})),
    ("Tensor.index_add_", "index", 3, 0, 4, lambda v: ((R45.clone(), 0, L([0, v]), torch.ones(2, 5)), {})),
    ("Torch.index_copy", "index", 3, 0, 4, lambda v: ((R45, 0, L([0, v]), torch.ones(2, 5)), {})),
    ("Tensor.index_fill_", "index", -4, -4, 4, lambda v: ((R45.clone(), 0, L([0, v]), 1.5), {})),
    ("Torch.index_reduce", "index", 3, 0, 4, lambda v: ((R45, 0, L([0, v]), torch.ones(2, 5), "amax"), {})),
    ("Torch.take", "index", -20, -20, 20, lambda v: ((R45, L([0, v])), {})),
    ("Tensor.put_", "index", 19, -20, 20, lambda v: ((R45.clone(), L([0, v]), torch.ones(2)), {})),
    ("Torch.take_along_dim", "indices", -5, -5, 5,
     lambda v: ((R45, _with(torch.zeros(4, 1, dtype=torch.long), v), 1), {})),
    # advanced indexing
    ("Tensor.__getitem__", "indices[1]", -5, -5, 5, lambda v: ((R45, (slice(None), L([0, v]))), {})),
    ("Tensor.__getitem__", "indices", 3, -4, 4, lambda v: ((R45, [0, v]), {})),
    ("Tensor.__getitem__", "indices[2]", 4, -5, 5, lambda v: ((R45, (None, Ellipsis, L([v]))), {})),
    ("Tensor.__setitem__", "indices[0]", -4, -4, 4, lambda v: ((R45.clone(), (L([v]), 1), 7.0), {})),
    ("Torch.index_put", "indices[1]", 4, -5, 5, lambda v: ((R45, (L([0, 3]), L([1, v])), torch.ones(2)), {})),
    ("Tensor.index_put_", "indices[0]", 3, -4, 4,
     lambda v: ((R45.clone(), (L([v]),), torch.ones(5)), {"accumulate": True})),
    # embeddings
    ("Functional.embedding", "input", 4, 0, 5, lambda v: ((L([0, v]), torch.ones(5, 3)), {})),
    ("Functional.embedding", "input", 4, 0, 5, lambda v: ((L([0, v]), torch.randn(5, 3)), {"max_norm": 0.5})),
    ("Torch.embedding", "indices", 4, 0, 5, lambda v: ((torch.ones(5, 3), L([0, v])), {})),
    ("Torch.embedding_renorm_", "indices", 4, 0, 5, lambda v: ((torch.randn(5, 3), L([0, v]), 0.5, 2.0), {})),
    ("Functional.embedding_bag", "input", 4, 0, 5, lambda v: ((L([0, 2, v]), torch.ones(5, 3), L([0, 1])), {})),
    ("Aten.embedding_bag", "offsets", 1, 0, 4,
     lambda v: ((torch.ones(5, 3), L([0, 2, 4]), L([0, v]), False, 0, False, None, False), {})),
    # pooling
    ("Functional.max_unpool2d", "indices", 15, 0, 16, lambda v: ((_pool()[1], _with(_pool()[2], v), 2), {})),
    # losses with class indices
    ("Functional.nll_loss", "target", 4, 0, 5, lambda v: ((LP[0], L([v, -100])), {})),
    ("Functional.cross_entropy", "target", 4, 0, 5, lambda v: ((LP[0], L([v, 1])), {"label_smoothing": 0.1})),
    ("Aten.nll_loss_forward", "target", 4, 0, 5, lambda v: ((LP[0], L([v, 1]), None, 1, -100), {})),
    ("Aten.nll_loss2d_forward", "target", 4, 0, 5,
     lambda v: ((LP[:4].permute(1, 2, 0).reshape(2, 5, 2, 2), _with(torch.zeros(2, 2, 2, dtype=torch.long), v), None,
                 1, -100), {})),
    ("Aten.nll_loss_backward", "target", 4, 0, 5,
     lambda v: ((L(1.0), LP[0], L([v, 1]), None, 1, -100, L(2.0)), {})),
    ("Aten.cross_entropy_loss", "target", 4, 0, 5, lambda v: ((LP[0], L([v, 1])), {})),
    ("Functional.multi_margin_loss", "target", 4, 0, 5, lambda v: ((LP[0], L([v, 1])), {})),
    ("Functional.multilabel_margin_loss", "target", 3, -1, 4,
     lambda v: ((R45[:2, :4], L([[3, v, -1, 0], [1, -1, 0, 0]])), {})),
    ("Functional.linear_cross_entropy", "target", 4, 0, 5,
     lambda v: ((R45[:2, :3], R45[:, :3].repeat(2, 1)[:5], L([v, 1])), {})),
    # segments, sorting, pivots, sequences
    ("Torch.segment_reduce", "lengths", 4, 0, 7, lambda v: ((torch.arange(6.0), "max"), {"lengths": L([2, v])})),
    ("Torch.searchsorted", "sorter", 4, 0, 5,
     lambda v: ((torch.arange(5.0), L([1.5, 3.5])), {"sorter": L([0, 1, 2, 3, v])})),
    ("Torch.linalg_lu_solve", "pivots", 3, 1, 4,
     lambda v: ((_lu()[0], _with(_lu()[1], v, 0), torch.ones(3, 2, dtype=torch.float64)), {})),
    ("Torch.lu_solve", "LU_pivots", 3, 1, 4,
     lambda v: ((torch.ones(3, 2, dtype=torch.float64), _lu()[0], _with(_lu()[1], v, 0)), {})),
    ("Torch.lu_unpack", "LU_pivots", 3, 1, 4, lambda v: ((_lu()[0], _with(_lu()[1], v, 0)), {})),
    ("Torch.linalg_ldl_solve", "pivots", 1, 1, 4,
     lambda v: ((_ldl()[0], _with(_ldl()[1], v, 0), torch.ones(3, 2, dtype=torch.float64)), {})),
    ("Torch.lstm", "batch_sizes", 2, 1, 3,
     lambda v: ((torch.ones(6, 3), L([2, v, 1, 1]), [torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)], LSTM, True, 1, 0.0,
                 False, False), {})),
    ("Functional.one_hot", "tensor", 5, 0, 6, lambda v: ((L([0, v]), 6), {})),
    ("Aten.one_hot", "self", 5, 0, 6, lambda v: ((L([0, v]), 6), {})),
    ("Functional.grouped_mm", "offs", 8, 0, 9,
     lambda v: ((torch.ones(8, 16, dtype=torch.bfloat16), torch.ones(2, 16, 8, dtype=torch.bfloat16).transpose(-2, -1)
                 .contiguous().transpose(-2, -1)), {"offs": L([4, v], dtype=torch.int32)})),
]


def _record(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, seq: int = 0) -> PendingRecord:
    inplace = name.endswith("__setitem__") or (name.endswith("_") and not name.endswith("__"))
    return PendingRecord(name=f"{name}.{seq}", step=0, inputs=snapshot((args, kwargs)), output=snapshot(out), seq=seq,
                         inplace=inplace)


def _call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    category, api = name.split(".")
    copies = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    out = registry.resolve(category, api)(*copies, **kwargs)
    return copies[0] if out is None else out   # `x[i] = v`: the call produced the new x


def _job(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any = None):
    """The call through the real wire encoding and the server's decoder."""
    return support.to_job(_record(name, args, kwargs, torch.zeros(1) if out is None else out))


def _ids(case: Case) -> str:
    return f"{case[0]}:{case[1]}"


def _bad_values(lo: int, hi: int, build: Callable[[int], Any]) -> list[int]:
    try:
        build(BIG)
    except RuntimeError:   # an int32 argument (pivots, offs): its own extremes
        return [hi, lo - 1, (1 << 31) - 1, -(1 << 31)]
    return [hi, lo - 1, BIG, -BIG]


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_an_index_outside_what_it_indexes_makes_the_record_not_replayable(case):
    name, param, good, lo, hi, build = case
    category, api = name.split(".")
    for v in _bad_values(lo, hi, build):
        args, kwargs = build(v)
        job = _job(name, args, kwargs)
        why = registry.replayable(category, api, job.args, job.kwargs)   # what the intake asks
        assert why is not None and why.startswith(f"not replayable: {name}: "), (v, why)
        bound = f"[{lo}, {hi})"
        assert f"'{param}'" in why and str(v) in why and bound in why, (v, why)
        with pytest.raises(ReplayError, match="not replayable"):  # and where the replay runs (a worker, a restart)
            run_forward(job, CPU, bench=True)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_an_index_inside_still_replays(case):
    name, param, good, lo, hi, build = case
    category, api = name.split(".")
    args, kwargs = build(good)
    out = _call(name, args, kwargs)
    job = _job(name, args, kwargs, out)
    assert registry.replayable(category, api, job.args, job.kwargs) is None, name
    replayed = run_forward(job, CPU, bench=False)
    first = replayed[0] if isinstance(replayed, (tuple, list)) else replayed
    want = out[0] if isinstance(out, (tuple, list)) else out
    assert first.shape == want.shape and first.dtype == want.dtype, name
    for v in (lo, hi - 1):   # the ends of the range are inside it (the call may be wrong for another reason)
        edge = _job(name, *build(v))
        why = index_problem(category, api, edge.args, edge.kwargs)
        assert why is None or f"outside [{lo}, {hi})" not in why, (v, why)


def test_segment_reduce_lengths_must_add_up_whatever_unsafe_says():
    """torch checks lengths only with unsafe=False and offsets never (an offset of 2**40 is a SIGSEGV): the server
    checks both in full, so unsafe=True replays only what it could replay safely."""
    data = torch.arange(6.0)
    for unsafe in (False, True):
        ok = {"lengths": L([2, 4]), "unsafe": unsafe}
        assert index_problem("Torch", "segment_reduce", (data, "sum"), ok) is None
        short = index_problem("Torch", "segment_reduce", (data, "sum"), {"lengths": L([2, 3]), "unsafe": unsafe})
        assert short and "adds up to 5, not the 6 entries" in short, short
        back = index_problem("Torch", "segment_reduce", (data, "sum"), {"offsets": L([0, 4, 2, 6]), "unsafe": unsafe})
        assert back and "'offsets' decreases" in back, back
    shaped = index_problem("Torch", "segment_reduce", (torch.ones(2, 3), "sum"), {"lengths": L([1, 2]), "axis": 1})
    assert shaped and "shaped like data's dimensions before axis 1" in shaped, shaped
    ok2d = index_problem("Torch", "segment_reduce", (torch.ones(2, 3), "sum"), {"lengths": L([[1, 2], [3, 0]]),
                                                                                "axis": 1})
    assert ok2d is None
    assert "indices=" in index_problem("Torch", "segment_reduce", (data, "sum"), {"indices": L([0, 0, 1, 1, 1, 2])})


def test_ctc_loss_lengths_and_blank_are_bounded():
    targets, il, tl = L([[1, 2, 3, 4], [1, 1, 2, 0]]), L([12, 10]), L([4, 3])
    assert index_problem("Functional", "ctc_loss", (LP, targets, il, tl)) is None
    assert "'input_lengths' holds 13, outside [0, 13)" in index_problem("Functional", "ctc_loss",
                                                                         (LP, targets, L([13, 10]), tl))
    assert "'target_lengths' holds 5, outside [0, 5)" in index_problem("Functional", "ctc_loss",
                                                                        (LP, targets, il, L([5, 3])))
    assert "'blank' is 5, outside [0, 5)" in index_problem("Functional", "ctc_loss", (LP, targets, il, tl, 5))
    # padding past a sequence's length is not read, so it may hold anything; 1-D targets are concatenated
    assert index_problem("Functional", "ctc_loss", (LP, L([[1, 2, 3, 4], [1, 1, 2, -7]]), il, tl)) is None
    assert index_problem("Torch", "ctc_loss", (LP, L([1, 2, 3, 4, 1, 1, 2]), [12, 10], [4, 3], 0, 1, False)) is None
    over = index_problem("Torch", "ctc_loss", (LP, L([1, 2, 3, 4, 1, 1, 9]), [12, 10], [4, 3], 0, 1, False))
    assert over and "'targets' holds 9, outside [0, 5)" in over, over


def test_embedding_bag_offsets_and_nll_ignore_index():
    w = torch.ones(5, 3)
    assert "starts at 1, not 0" in index_problem("Functional", "embedding_bag", (L([0, 1, 2]), w, L([1, 2])))
    assert "decreases" in index_problem("Functional", "embedding_bag", (L([0, 1, 2]), w, L([0, 2, 1])))
    last = index_problem("Torch", "embedding_bag", (w, L([0, 1, 2]), L([0, 2, 4]), False, 0, False, None, True))
    assert last and "'offsets' holds 4, outside [0, 4)" in last, last
    assert index_problem("Functional", "nll_loss", (LP[0], L([1, 7])), {"ignore_index": 7}) is None
    assert index_problem("Functional", "cross_entropy", (LP[0], LP[0].softmax(1))) is None   # probabilities
    assert "holds -100" in index_problem("Functional", "nll_loss", (LP[0], L([1, -100])), {"ignore_index": 2})


def test_repeat_interleave_counts_and_masked_scatter_sources():
    x = torch.arange(3.0)
    assert index_problem("Torch", "repeat_interleave", (x, L([1, 2, 3])), {"output_size": 6}) is None
    assert "'output_size' is 7" in index_problem("Torch", "repeat_interleave", (x, L([1, 2, 3])), {"output_size": 7})
    assert "'repeats' holds -1" in index_problem("Torch", "repeat_interleave", (L([1, -1]),))
    assert "'self' holds -3" in index_problem("Torch", "bincount", (L([1, -3]),))
    mask = L([True, False, True, True])
    assert index_problem("Tensor", "masked_scatter_", (torch.zeros(4), mask, torch.ones(3))) is None
    short = index_problem("Tensor", "masked_scatter_", (torch.zeros(2, 4), mask, torch.ones(5)))
    assert short and "selects 6 positions but 'source' holds 5" in short, short


def test_a_check_that_cannot_read_its_arguments_refuses_the_call():
    why = index_problem("Torch", "ctc_loss", (LP, L([[1, 2]]), "twelve", L([2])))
    assert why and why.startswith("not replayable: Torch.ctc_loss:"), why


# -- the rules cover every index-taking API of the allowlist ----------------------------------------------------------
INDEX_ARGUMENTS = {"index", "indices", "target", "targets", "input_lengths", "target_lengths", "lengths", "offsets",
                   "pivots", "LU_pivots", "sorter", "batch_sizes", "offs", "repeats"}
# allowlisted APIs with an argument of such a name that indexes nothing: values, not positions
NOT_INDICES = set("""
binary_cross_entropy binary_cross_entropy_backward binary_cross_entropy_with_logits cosine_embedding_loss
hinge_embedding_loss margin_ranking_loss kl_div l1_loss mse_loss mse_loss_backward huber_loss huber_loss_backward
smooth_l1_loss smooth_l1_loss_backward soft_margin_loss poisson_nll_loss multilabel_soft_margin_loss gaussian_nll_loss
triplet_margin_loss
""".split())


def _aten_index_arguments(api: str) -> set[str]:
    names: set[str] = set()
    for candidate in {api, api[:-1] if api.endswith("_") and not api.endswith("__") else api}:
        packet = getattr(torch.ops.aten, candidate, None) if candidate in _ATEN_OPS else None
        if packet is None:
            continue
        for overload in packet.overloads():
            schema = getattr(packet, overload)._schema
            if any(a.is_out for a in schema.arguments):
                continue
            names |= {a.name for a in schema.arguments if a.name in INDEX_ARGUMENTS and "Tensor" in str(a.type)}
    return names


_ATEN_OPS = frozenset(n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                      if n.startswith("aten::"))


def test_every_allowlisted_api_with_an_index_argument_has_a_rule():
    missing = []
    for category in ("Torch", "Tensor", "Aten"):
        for api in sorted(apis.ALLOWLIST[category]):
            found = _aten_index_arguments(api)
            if found and api not in NOT_INDICES and not any(category in r.categories for r in RULES.get(api, ())):
                missing.append(f"{category}.{api} ({', '.join(sorted(found))})")
    for api in sorted(apis.FUNCTIONAL):
        fn = getattr(F, api)
        try:
            params = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        found = params & INDEX_ARGUMENTS
        if found and api not in NOT_INDICES and not any("Functional" in r.categories for r in RULES.get(api, ())):
            missing.append(f"Functional.{api} ({', '.join(sorted(found))})")
    assert not missing, ("allowlisted APIs with index arguments and no rule in gpu_server/replay/native_bounds.py: "
                         f"{missing}")
    # and the rules name allowlisted APIs only (a rule for a name nobody can send is a typo)
    dead = [f"{r.categories}.{api}" for api, rules in RULES.items() for r in rules
            if not any(api in apis.ALLOWLIST[c] for c in r.categories)]
    assert not dead, dead
    # the APIs the audit found, and the families named by the issue, are covered
    for category, api in [("Aten", "max_pool2d_with_indices_backward"), ("Aten", "embedding_dense_backward"),
                          ("Aten", "embedding_backward"), ("Torch", "segment_reduce"), ("Functional", "ctc_loss"),
                          ("Torch", "gather"), ("Tensor", "scatter_"), ("Functional", "embedding"),
                          ("Torch", "take"), ("Tensor", "put_"), ("Torch", "index_select"), ("Tensor", "__getitem__")]:
        assert any(category in r.categories for r in RULES.get(api, ())), (category, api)


# -- through a real server ---------------------------------------------------------------------------------------
def _frames(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, seq: int, run_id: str) -> list[bytes]:
    enc = encode_record(_record(name, args, kwargs, out, seq), run_id, 0)
    return list(enc.wire_frames(1 << 20))


def test_bad_index_records_through_a_real_server_are_skip_and_it_keeps_serving(tmp_path):
    """Records that killed the server (2**40 into max_pool2d_with_indices_backward: SIGSEGV) or wrote past a heap
    buffer (100,000 into embedding_dense_backward) are REJECTED at intake with the reason, reported SKIP, and the
    server goes on to check the honest records sent after them."""
    x, out, idx = _pool()
    grad = torch.ones_like(out)
    honest_pool = ("Aten.max_pool2d_with_indices_backward",
                   (grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx), {})
    honest_pool_out = torch.ops.aten.max_pool2d_with_indices_backward(*honest_pool[1])
    hostile = [
        ("Aten.max_pool2d_with_indices_backward", (grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, _with(idx, BIG)),
         {}, "'indices' holds 1099511627776, outside [0, 16)"),
        ("Aten.embedding_dense_backward", (torch.ones(3, 4), L([0, 1, 100_000]), 5, -1, False), {},
         "'indices' holds 100000, outside [0, 5)"),
        ("Aten.embedding_backward", (torch.ones(3, 4), L([0, 1, -100_000]), 5, -1, True, False), {},
         "'indices' holds -100000, outside [0, 5)"),
        ("Torch.segment_reduce", (torch.arange(6.0), "sum"), {"offsets": L([0, 2, BIG]), "unsafe": True},
         "'offsets' holds 1099511627776, outside [0, 7)"),
        ("Functional.ctc_loss", (LP, L([[1, BIG, 2, 3], [1, 1, 2, 0]]), L([12, 10]), L([4, 3])), {},
         "'targets' holds 1099511627776, outside [0, 5)"),
        ("Aten.embedding_bag", (torch.ones(5, 3), L([0, 2, 4]), L([0, -100_000]), False, 0, False, None, False), {},
         "'offsets' holds -100000, outside [0, 4)"),
    ]
    honest = [honest_pool + (honest_pool_out,),
              ("Functional.embedding", (L([0, 4, 2]), torch.arange(15.0).reshape(5, 3)), {},
               F.embedding(L([0, 4, 2]), torch.arange(15.0).reshape(5, 3)))]
    hello = pb.Frame(hello=pb.Hello(run_id="bounds", rank=0)).SerializeToString()
    msgs = [hello]
    for seq, (name, args, kwargs, _) in enumerate(hostile):
        msgs += _frames(name, args, kwargs, torch.zeros(1), seq, "bounds")
    for seq, (name, args, kwargs, out) in enumerate(honest, start=len(hostile)):
        msgs += _frames(name, args, kwargs, out, seq, "bounds")
    total = len(hostile) + len(honest)
    with support.Server(str(tmp_path)) as srv:
        acks = support.stream_acks(srv.port, msgs, lambda acks: len(acks) >= total)
        alive = srv.proc.poll() is None
        code = srv.stop()
        log = srv.log()
    statuses = [(a.seq, a.status) for a in acks]
    assert statuses == [(i, pb.Ack.REJECTED) for i in range(len(hostile))] + [
        (i, pb.Ack.ACCEPTED) for i in range(len(hostile), total)], acks
    for ack, (name, _, _, reason) in zip(acks, hostile):
        assert f"{name}: " in ack.reason and reason in ack.reason and "not replayable" in ack.reason, ack.reason
    assert alive and code == 0, log[-3000:]
    assert "Traceback" not in log
    rows = support.by_name(support.read_csv(srv.out, "accuracy_checking_result"))
    for seq, (name, _, _, reason) in enumerate(hostile):
        row = rows[f"{name}.{seq}"]
        assert row["Forward Test Success"] == "SKIP" and reason in row["Message"], row
    for seq, (name, *_rest) in enumerate(honest, start=len(hostile)):
        assert rows[f"{name}.{seq}"]["Forward Test Success"] == "pass", rows[f"{name}.{seq}"]
