"""torch_npu fused operators end to end (issue 7): NPU records through a real gpu-server, backward through the
references, and the agent's capture of `npu` operators on a host without torch_npu.

The "device" is the reference itself evaluated in the device dtype (bfloat16/float16 where the NPU operator supports
it, float32 otherwise), so a correct record must pass, and the same record with its main output (or one gradient)
scaled by 1 + 2^-5 must be flagged `error`. torch_npu is never imported: an operator in the `npu` namespace is defined
here with `torch.library` (its CPU kernel calls our reference) to stand in for the real kernel, and a
`types.ModuleType("torch_npu")` stands in for the module.

One gpu-server process serves the whole module: the `reports` fixture sends every hand-built record over raw gRPC
(rank 0) and runs two training subprocesses (ranks 1 and 2), then stops the server and reads the CSVs.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types

import grpc
import pytest
import torch
from torch.overrides import handle_torch_function, has_torch_function

from gpu_server.replay.fused import FUSED_REFERENCES, get_reference
from npu_agent import naming
from npu_agent.capture import autocast_state
from npu_agent.records import BACKWARD, PendingRecord, encode_record
from npu_agent.snapshot import iter_tensors, snapshot
from protos import online_check_pb2 as pb
from protos.contract import STREAM_METHOD
from tests.support import Server, agent_config, by_name, capture, read_csv, run_training

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
WRONG = 1 + 2 ** -5
RUN_ID = "npuops"
COMPRESSED = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
BENCHMARK_ALGORITHM = "标杆比对法"


def _rand(gen, *shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ------------------------------------------------------------------------------------------- sample calls
def forward_cases() -> list[tuple[str, tuple, dict]]:
    """(operator, args, kwargs) in torch_npu's signature and the device dtype, one or more per registered operator."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s, **kw: _rand(g, *s, **kw)  # noqa: E731
    cases = [
        ("npu_fusion_attention", (r(2, 8, 32), r(2, 8, 16), r(2, 8, 16), 4, "BSH"), {"scale": 0.35}),  # GQA
        ("npu_fusion_attention", (r(2, 8, 32), r(2, 8, 32), r(2, 8, 32), 4, "BSH"),
         {"atten_mask": COMPRESSED, "sparse_mode": 2, "scale": 0.35}),
        ("npu_fusion_attention", (r(9, 2, 8, dtype=FP16), r(10, 2, 8, dtype=FP16), r(10, 2, 8, dtype=FP16), 2, "TND"),
         {"atten_mask": COMPRESSED, "sparse_mode": 3, "actual_seq_qlen": [4, 9], "actual_seq_kvlen": [5, 10],
          "scale": 0.35}),
        ("npu_rms_norm", (r(2, 4, 16), r(16)), {}),
        ("npu_rotary_mul", (r(2, 4, 2, 8), r(1, 4, 1, 8), r(1, 4, 1, 8)), {}),
        ("npu_swiglu", (r(2, 4, 16),), {"dim": -1}),
        ("npu_scaled_masked_softmax", (r(2, 2, 4, 8, dtype=FP16), torch.rand(2, 1, 4, 8, generator=g) < 0.3),
         {"scale": 0.5}),
        ("npu_fast_gelu", (r(4, 8, dtype=FP16),), {}),
        ("npu_linear", (r(4, 8), r(6, 8), r(6)), {}),
        ("npu_confusion_transpose", (r(2, 3, 4, 8), [0, 2, 1, 3], [2, 4, 24], True), {}),
        ("npu_layer_norm_eval", (r(3, 8, dtype=FP16), [8], r(8, dtype=FP16), r(8, dtype=FP16)), {"eps": 1e-5}),
        ("npu_apply_adam", (0.9, 0.999, 0.01, 0.9, 0.999, 1e-8, r(4, 4, dtype=FP32), False, False),
         {"out": (r(4, 4, dtype=FP32), r(4, 4, dtype=FP32), r(4, 4, dtype=FP32).abs())}),
        ("npu_apply_adam_w", (0.81, 0.998, 0.01, 0.01, 0.9, 0.999, 1e-8, r(4, 4, dtype=FP32), None, False, False),
         {"out": (r(4, 4, dtype=FP32), r(4, 4, dtype=FP32), r(4, 4, dtype=FP32).abs())}),
        ("npu_group_norm_silu", (r(2, 4, 3, 3), r(4), r(4), 2), {}),
        ("npu_mish", (r(4, 8, dtype=FP16),), {}),
        ("npu_moe_gating_top_k_softmax", (r(6, 8),), {"k": 2}),
        ("npu_sort_v2", (r(3, 16),), {}),
    ]
    return cases


def backward_cases() -> list[tuple[str, tuple, dict]]:
    """(operator, args, kwargs) whose floating tensor inputs require grad, as in training."""
    g = torch.Generator().manual_seed(1)

    def r(*s, dtype=BF16):
        return _rand(g, *s, dtype=dtype).requires_grad_(True)

    return [
        ("npu_rms_norm", (r(2, 4, 16), r(16)), {}),
        ("npu_swiglu", (r(2, 4, 16),), {}),
        ("npu_rotary_mul", (r(2, 4, 2, 8), r(1, 4, 1, 8), r(1, 4, 1, 8)), {}),
        ("npu_fusion_attention", (r(2, 8, 32), r(2, 8, 16), r(2, 8, 16), 4, "BSH"), {"scale": 0.35}),
        ("npu_fusion_attention", (r(2, 8, 32), r(2, 8, 32), r(2, 8, 32), 4, "BSH"),
         {"atten_mask": COMPRESSED, "sparse_mode": 2, "scale": 0.35}),
        ("npu_fusion_attention", (r(9, 2, 8), r(10, 2, 8), r(10, 2, 8), 2, "TND"),
         {"atten_mask": COMPRESSED, "sparse_mode": 3, "actual_seq_qlen": [4, 9], "actual_seq_kvlen": [5, 10],
          "scale": 0.35}),
    ]


def _named(cases):
    counters = naming.Counters()
    return [(counters.next_name("NPU", op), op, args, kwargs) for op, args, kwargs in cases]


# ---------------------------------------------------------------------------------------- building records
def _scale_first_float(out, factor: float):
    """The output with its first floating tensor (the operator's main output) multiplied by `factor`."""
    done = False

    def fix(v):
        nonlocal done
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() and not done:
            done = True
            return (v.float() * factor).to(v.dtype)
        if isinstance(v, (tuple, list)):
            return type(v)(fix(x) for x in v)
        return v

    out = fix(out)
    assert done
    return out


def forward_record(name: str, op: str, args: tuple, kwargs: dict, step: int, wrong: bool = False,
                   backward: bool = False) -> tuple[PendingRecord, object]:
    """The forward record the agent would send for `torch_npu.{op}(*args, **kwargs)`, the device being the reference
    in the inputs' dtype. Returns the record and the (differentiable) output."""
    rec = PendingRecord(name=name, step=step, grad_enabled=backward, inplace=naming.is_inplace(op, kwargs),
                        autocast=autocast_state(args, kwargs), backward_expected=backward)
    rec.inputs = snapshot((args, kwargs))
    with torch.set_grad_enabled(backward):
        out = get_reference(op)(*args, **kwargs)
    rec.output = snapshot(_scale_first_float(out, WRONG) if wrong else out)
    return rec, out


def backward_record(name: str, args: tuple, kwargs: dict, out, step: int, seed: int,
                    wrong: bool = False) -> tuple[PendingRecord, list]:
    """The backward record the agent would send: grad_output for every tensor output (None where no gradient reached
    it: attention's softmax_* outputs, rms_norm's rstd), grad_input for each input that required grad."""
    leaves, positions = [], []
    for i, t in enumerate(iter_tensors((args, kwargs))):
        if t.requires_grad:
            leaves.append(t)
            positions.append(i)
    outs = list(iter_tensors(out))
    g = torch.Generator().manual_seed(seed)
    grad_out = [_rand(g, *outs[0].shape, dtype=outs[0].dtype)] + [None] * (len(outs) - 1)
    grads = list(torch.autograd.grad(outs[0], leaves, grad_out[0]))
    if wrong:
        grads[0] = _scale_first_float(grads[0], WRONG)
    rec = PendingRecord(name=name, step=step, direction=BACKWARD, grad_output=snapshot(grad_out),
                        grad_input=snapshot(grads), grad_input_positions=tuple(positions), grad_enabled=True)
    return rec, grads


STEP_FWD, STEP_FWD_WRONG, STEP_BWD, STEP_BWD_WRONG = 0, 1, 2, 3
UNKNOWN = "NPU.npu_not_there.0"
DROPOUT = "NPU.npu_fusion_attention.3"  # keep_prob < 1: the NPU's own dropout mask is not recorded


def build_records() -> tuple[list[PendingRecord], dict]:
    """Every record of parts 1 and 2, and what the tests expect of them: {"forward": names, "backward": {name:
    number of grad_inputs}}."""
    recs: list[PendingRecord] = []
    expected = {"forward": [], "backward": {}}
    for name, op, args, kwargs in _named(forward_cases()):
        recs.append(forward_record(name, op, args, kwargs, STEP_FWD)[0])
        recs.append(forward_record(name, op, args, kwargs, STEP_FWD_WRONG, wrong=True)[0])
        expected["forward"].append(name)
    for i, (name, op, args, kwargs) in enumerate(_named(backward_cases())):
        for step, wrong in ((STEP_BWD, False), (STEP_BWD_WRONG, True)):
            fwd, out = forward_record(name, op, args, kwargs, step, backward=True)
            bwd, grads = backward_record(name, args, kwargs, out, step, seed=i, wrong=wrong)
            recs += [fwd, bwd]
        expected["backward"][name] = len(grads)
    g = torch.Generator().manual_seed(2)
    q, k, v = (_rand(g, 1, 4, 16) for _ in range(3))
    drop = PendingRecord(name=DROPOUT, step=STEP_FWD, autocast=autocast_state((q,), {}))
    kwargs = {"keep_prob": 0.9}
    drop.inputs = snapshot(((q, k, v, 2, "BSH"), kwargs))
    keep = torch.rand(1, 2, 4, 4, generator=g) < 0.9
    drop.output = snapshot(get_reference("npu_fusion_attention")(q, k, v, 2, "BSH", _dropout_mask=keep, **kwargs))
    recs.append(drop)
    unknown = PendingRecord(name=UNKNOWN, step=STEP_FWD)
    x = torch.randn(3, 4).to(BF16)
    unknown.inputs = snapshot(((x,), {}))
    unknown.output = snapshot(x * 2)
    recs.append(unknown)
    for seq, rec in enumerate(recs):
        rec.seq = seq
    return recs, expected


def send_raw(port: int, recs: list[PendingRecord]) -> list:
    """Stream the records to the server over raw gRPC (as tests/test_e2e.py does); the acknowledgements."""
    frames = []
    for rec in recs:
        enc = encode_record(rec, RUN_ID, 0)
        frames += list(enc.wire_frames(1 << 20))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stream = channel.stream_stream(STREAM_METHOD, request_serializer=None,
                                       response_deserializer=pb.Ack.FromString)
        return list(stream(iter(frames), timeout=60))
    finally:
        channel.close()


# ------------------------------------------------------------------ torch.library stand-ins for torch_npu kernels
NPU_SCHEMAS = {
    "npu_rms_norm": ("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)", 2),
    "npu_swiglu": ("npu_swiglu(Tensor self, int dim=-1) -> Tensor", 1),
}
_LIB: list = []


def define_npu_ops() -> None:
    """Define `torch.ops.npu.npu_rms_norm` and `torch.ops.npu.npu_swiglu` (schemas as torch_npu's) with a CPU kernel
    that calls our reference and an autograd formula through the reference. Idempotent."""
    if _LIB:
        return
    lib = torch.library.Library("npu", "DEF")  # the namespace torch_npu owns on an Ascend host
    _LIB.append(lib)
    for op, (schema, n_tensors) in NPU_SCHEMAS.items():
        ref = get_reference(op)
        lib.define(schema)

        def kernel(*args, _ref=ref):
            out = _ref(*args)
            return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

        def setup_context(ctx, inputs, output, _n=n_tensors):
            ctx.save_for_backward(*inputs[:_n])
            ctx.rest = inputs[_n:]

        def backward(ctx, *grads, _ref=ref):
            with torch.enable_grad():
                ins = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
                out = _ref(*ins, *ctx.rest)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], ins, [g for _, g in pairs], allow_unused=True)
            return (*got, *([None] * len(ctx.rest)))

        lib.impl(op, kernel, "CPU")
        torch.library.register_autograd(f"npu::{op}", backward, setup_context=setup_context, lib=lib)


def stand_in_torch_npu() -> types.ModuleType:
    """A `torch_npu` module object whose npu_* functions take part in `__torch_function__` as torch_npu's C++
    bindings do (a plain Python function is invisible to a TorchFunctionMode) and run the `npu` library op."""
    define_npu_ops()
    mod = types.ModuleType("torch_npu")

    def npu_rms_norm(self, gamma, epsilon=1e-6):
        if has_torch_function((self, gamma)):
            return handle_torch_function(npu_rms_norm, (self, gamma), self, gamma, epsilon=epsilon)
        return torch.ops.npu.npu_rms_norm(self, gamma, epsilon)

    def npu_swiglu(self, dim=-1):
        if has_torch_function((self,)):
            return handle_torch_function(npu_swiglu, (self,), self, dim=dim)
        return torch.ops.npu.npu_swiglu(self, dim)

    def _private_helper(x):
        return x

    mod.npu_rms_norm, mod.npu_swiglu, mod._private_helper = npu_rms_norm, npu_swiglu, _private_helper
    mod.npu = types.ModuleType("torch_npu.npu")  # a submodule: never an API
    return mod


# A training loop (bfloat16) whose model calls the fused operators: `torch.ops.npu.*` directly (argv[2] == "ops", no
# torch_npu anywhere), or `torch_npu.npu_*` through the stand-in module put in sys.modules (argv[2] == "module").
TRAIN = r"""
import importlib.util, json, sys, torch
from tests.test_npu_ops import define_npu_ops, stand_in_torch_npu
mode = sys.argv[2]
if mode == "module":
    sys.modules["torch_npu"] = stand_in_torch_npu()
else:
    assert importlib.util.find_spec("torch_npu") is None, "this test needs a host without torch_npu"
    define_npu_ops()
from npu_agent import PrecisionDebugger, naming
torch.manual_seed(0)
w1 = torch.nn.Parameter((torch.randn(16, 16) * 0.2).to(torch.bfloat16))
gamma = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16) + 0.1 * torch.randn(16).to(torch.bfloat16))
w2 = torch.nn.Parameter((torch.randn(32, 16) * 0.2).to(torch.bfloat16))
params = [w1, gamma, w2]
dbg = PrecisionDebugger(config_path=sys.argv[1])
for step in range(2):
    x = torch.randn(4, 6, 16).to(torch.bfloat16)
    dbg.start()
    h = torch.nn.functional.linear(x, w1)
    if mode == "module":
        import torch_npu
        y, _ = torch_npu.npu_rms_norm(h, gamma)
        z = torch_npu.npu_swiglu(torch.nn.functional.linear(y, w2))
    else:
        y, _ = torch.ops.npu.npu_rms_norm(h, gamma, 1e-6)
        z = torch.ops.npu.npu_swiglu(torch.nn.functional.linear(y, w2), -1)
    loss = z.float().pow(2).mean()
    loss.backward()
    dbg.stop()
    with torch.no_grad():
        for p in params:
            p -= 0.1 * p.grad
            p.grad = None
    dbg.step()
counts = dbg.close()
info = {"torch_npu_loaded": "torch_npu" in sys.modules, "counts": counts}
if mode == "module":
    info["classified"] = naming.classify(sys.modules["torch_npu"].npu_rms_norm)
print("INFO " + json.dumps(info))
"""


def _info(proc) -> dict:
    line = next(x for x in proc.stdout.splitlines() if x.startswith("INFO "))
    return json.loads(line[len("INFO "):])


# ------------------------------------------------------------------------------------------- the one server
@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    work = tmp_path_factory.mktemp("npu_ops")
    recs, expected = build_records()
    with Server(str(work)) as srv:
        acks = send_raw(srv.port, recs)
        runs = {}
        for rank, mode in ((1, "ops"), (2, "module")):
            cfg = agent_config(str(work / f"agent_{rank}.json"), srv.port)
            runs[mode] = _info(run_training(TRAIN, cfg, mode, env={"RANK": str(rank)}, timeout=120))
        srv.stop()
    assert "Traceback" not in srv.log(), srv.log()[-3000:]
    return {"out": srv.out, "acks": acks, "recs": recs, "expected": expected, "runs": runs}


def _rows(out: str, kind: str, step: int, rank: int = 0, key: str = "API name") -> dict[str, dict]:
    return by_name([r for r in read_csv(out, kind, rank) if r["Step"] == str(step)], key)


# ------------------------------------------------------------------------------- 1. forward through the server
def test_every_fused_operator_is_covered():
    assert {op for op, _, _ in forward_cases()} == set(FUSED_REFERENCES)
    fa = [kw for op, args, kw in forward_cases() if op == "npu_fusion_attention"]
    layouts = {args[4] for op, args, _ in forward_cases() if op == "npu_fusion_attention"}
    assert {"BSH", "TND"} <= layouts and any(kw.get("sparse_mode") in (2, 3) for kw in fa)


def test_records_are_accepted_and_unknown_operator_is_rejected(reports):
    acks = reports["acks"]
    assert len(acks) == len(reports["recs"])
    by_seq = {a.seq: a for a in acks}
    for rec in reports["recs"]:
        ack = by_seq[rec.seq]
        if rec.name == UNKNOWN:
            assert ack.status == pb.Ack.REJECTED and "npu_not_there" in ack.reason, ack
        else:
            assert ack.status == pb.Ack.ACCEPTED, (rec.name, ack)


def test_correct_forward_records_pass_with_the_benchmark_standard(reports):
    out, names = reports["out"], reports["expected"]["forward"]
    results = _rows(out, "accuracy_checking_result", STEP_FWD)
    precision = _rows(out, "api_precision_compare_result", STEP_FWD, key="API Name")
    details = _rows(out, "accuracy_checking_details", STEP_FWD, key="API Name")
    pdetails = _rows(out, "api_precision_compare_details", STEP_FWD, key="API Name")
    all_results = [r for r in read_csv(out, "accuracy_checking_result") if r["Step"] == str(STEP_FWD)]
    for name in names:
        assert [r["API name"] for r in all_results].count(name) == 1, name
        assert results[name]["Forward Test Success"] == "pass", results[name]
        assert results[name]["Backward Test Success"].strip() == "", results[name]
        assert precision[name]["Forward Test Success"] == "pass", precision[name]
        row = f"{name}.forward.output.0"
        assert details[row]["Status"] == "pass", details[row]
        assert pdetails[row]["比对算法"] == BENCHMARK_ALGORITHM, (row, pdetails[row]["比对算法"])
        assert pdetails[row]["比对结果"] == "pass", pdetails[row]
    # integer outputs of a fused operator are judged bit for bit
    assert pdetails["NPU.npu_moe_gating_top_k_softmax.0.forward.output.1"]["比对算法"] == "二进制一致法"
    # every compared output of attention has a row: out, softmax_max, softmax_sum, softmax_out, seed, offset, numels
    assert {f"NPU.npu_fusion_attention.2.forward.output.{i}" for i in range(7)} <= set(details)
    assert details["NPU.npu_fusion_attention.0.forward.output.0"]["DEVICE Dtype"] == "torch.bfloat16"
    assert details["NPU.npu_fusion_attention.0.forward.output.0"]["Bench Dtype"] == "torch.float32"


def test_wrong_device_output_is_flagged_error(reports):
    out, names = reports["out"], reports["expected"]["forward"]
    results = _rows(out, "accuracy_checking_result", STEP_FWD_WRONG)
    precision = _rows(out, "api_precision_compare_result", STEP_FWD_WRONG, key="API Name")
    details = _rows(out, "accuracy_checking_details", STEP_FWD_WRONG, key="API Name")
    for name in names:
        assert results[name]["Forward Test Success"] == "error", results[name]
        assert precision[name]["Forward Test Success"] == "error", precision[name]
        assert details[f"{name}.forward.output.0"]["Status"] == "error", details[f"{name}.forward.output.0"]


def test_operator_without_reference_is_a_skip_naming_it(reports):
    out = reports["out"]
    for kind, key in (("accuracy_checking_result", "API name"), ("api_precision_compare_result", "API Name")):
        row = _rows(out, kind, STEP_FWD, key=key)[UNKNOWN]
        assert row["Forward Test Success"] == "SKIP", row
        assert "no reference implementation" in row["Message"] and "npu_not_there" in row["Message"], row


def test_attention_with_dropout_is_a_skip_saying_why(reports):
    # without the recorded keep mask (the NPU's Philox mask cannot be regenerated) the reference cannot replay it
    for kind, key in (("accuracy_checking_result", "API name"), ("api_precision_compare_result", "API Name")):
        row = _rows(reports["out"], kind, STEP_FWD, key=key)[DROPOUT]
        assert row["Forward Test Success"] == "SKIP", row
        assert "random dropout mask" in row["Message"] and "keep_prob=0.9" in row["Message"], row


# ------------------------------------------------------------------------------ 2. backward through the server
def test_backward_records_replay_through_the_reference_and_pass(reports):
    out, expected = reports["out"], reports["expected"]["backward"]
    assert {"NPU.npu_rms_norm.0", "NPU.npu_swiglu.0", "NPU.npu_rotary_mul.0",
            "NPU.npu_fusion_attention.0", "NPU.npu_fusion_attention.2"} <= set(expected)
    results = _rows(out, "accuracy_checking_result", STEP_BWD)
    precision = _rows(out, "api_precision_compare_result", STEP_BWD, key="API Name")
    details = _rows(out, "accuracy_checking_details", STEP_BWD, key="API Name")
    pdetails = _rows(out, "api_precision_compare_details", STEP_BWD, key="API Name")
    for name, n_grads in expected.items():
        for rows in (results, precision):
            assert rows[name]["Forward Test Success"] == "pass", rows[name]
            assert rows[name]["Backward Test Success"] == "pass", rows[name]
        for i in range(n_grads):
            row = f"{name}.backward.output.{i}"
            assert details[row]["Status"] == "pass", details[row]
            assert pdetails[row]["比对算法"] == BENCHMARK_ALGORITHM, pdetails[row]
        assert f"{name}.backward.output.{n_grads}" not in details


def test_wrong_grad_input_is_flagged_on_the_backward_only(reports):
    out, expected = reports["out"], reports["expected"]["backward"]
    results = _rows(out, "accuracy_checking_result", STEP_BWD_WRONG)
    precision = _rows(out, "api_precision_compare_result", STEP_BWD_WRONG, key="API Name")
    details = _rows(out, "accuracy_checking_details", STEP_BWD_WRONG, key="API Name")
    for name, n_grads in expected.items():
        for rows in (results, precision):
            assert rows[name]["Forward Test Success"] == "pass", rows[name]
            assert rows[name]["Backward Test Success"] == "error", rows[name]
        assert details[f"{name}.backward.output.0"]["Status"] == "error"
        for i in range(1, n_grads):
            assert details[f"{name}.backward.output.{i}"]["Status"] == "pass", details[f"{name}.backward.output.{i}"]


# -------------------------------------------------------------------- 3. capture of npu operators (no torch_npu)
def test_torch_npu_is_not_required():
    assert importlib.util.find_spec("torch_npu") is None  # this host has no torch_npu: everything here runs without
    assert "torch_npu" not in sys.modules


def test_capture_of_torch_ops_npu_forward_and_backward():
    define_npu_ops()
    g = torch.Generator().manual_seed(5)
    x = _rand(g, 3, 4, 16).requires_grad_(True)
    gamma = (1 + 0.1 * _rand(g, 16)).requires_grad_(True)
    gamma2 = (1 + 0.1 * _rand(g, 16)).requires_grad_(True)
    with capture() as (mode, sink):
        with mode:
            y0, _ = torch.ops.npu.npu_rms_norm(x, gamma)
            y1, _ = torch.ops.npu.npu_rms_norm.default(y0 * 2, gamma2, epsilon=1e-5)
            z = torch.ops.npu.npu_swiglu(y1, -1)
            loss = z.float().pow(2).sum()
            loss.backward()
    assert sink.names() == ["NPU.npu_rms_norm.0", "Tensor.mul.0", "NPU.npu_rms_norm.1", "NPU.npu_swiglu.0",
                            "Tensor.float.0", "Tensor.pow.0", "Tensor.sum.0"]
    assert set(sink.names(BACKWARD)) >= {"NPU.npu_rms_norm.0", "NPU.npu_rms_norm.1", "NPU.npu_swiglu.0"}

    # the same graph without capture: what each call's grad_input must be
    xr, gr, g2r = (t.detach().clone().requires_grad_(True) for t in (x, gamma, gamma2))
    y0r, _ = torch.ops.npu.npu_rms_norm(xr, gr)
    m = y0r * 2
    y1r, _ = torch.ops.npu.npu_rms_norm(m, g2r, epsilon=1e-5)
    zr = torch.ops.npu.npu_swiglu(y1r, -1)
    want = torch.autograd.grad(zr.float().pow(2).sum(), (xr, gr, m, g2r, y1r))
    expect = {"NPU.npu_rms_norm.0": (want[0], want[1]), "NPU.npu_rms_norm.1": (want[2], want[3]),
              "NPU.npu_swiglu.0": (want[4],)}
    for name, grads in expect.items():
        fwd, bwd = sink.forward(name), sink.backward(name)
        assert fwd.backward_expected and fwd.grad_enabled
        assert bwd.grad_input_positions == tuple(range(len(grads)))
        assert len(bwd.grad_input.tree) == len(grads)
        for got, exp in zip(bwd.grad_input.tree, grads):
            assert torch.equal(got, exp), name
    # rms_norm's rstd output got no gradient; its y did
    grad_out = sink.backward("NPU.npu_rms_norm.0").grad_output.tree
    assert len(grad_out) == 2 and grad_out[0] is not None and grad_out[1] is None
    # inputs snapshotted as torch_npu's signature: positional tensors, the keyword as given
    args, kwargs = sink.forward("NPU.npu_rms_norm.1").inputs.tree
    assert len(args) == 2 and kwargs == {"epsilon": 1e-5}
    assert torch.equal(sink.forward("NPU.npu_rms_norm.0").output.tree[0], y0.detach())


def test_register_npu_namespace_with_a_stand_in_module():
    mod = stand_in_torch_npu()
    assert naming.classify(mod.npu_rms_norm) is None  # a Python function of another module: not an API yet
    assert naming.register_npu_namespace(mod) == 2   # npu_* only: not _private_helper, not the submodule
    assert naming.classify(mod.npu_rms_norm) == ("NPU", "npu_rms_norm")
    assert naming.classify(mod.npu_swiglu) == ("NPU", "npu_swiglu")
    assert naming.classify(mod._private_helper) is None
    g = torch.Generator().manual_seed(6)
    x = _rand(g, 2, 3, 8).requires_grad_(True)
    gamma = _rand(g, 8).requires_grad_(True)
    with capture() as (mode, sink):
        with mode:
            y, _ = mod.npu_rms_norm(x, gamma)
            z = mod.npu_swiglu(y)
            z.sum().backward()
    # one record per torch_npu call: the `torch.ops.npu` op it runs inside is not a second record
    assert [n for n in sink.names() if n.startswith("NPU.")] == ["NPU.npu_rms_norm.0", "NPU.npu_swiglu.0"]
    assert sink.backward("NPU.npu_rms_norm.0").grad_input_positions == (0, 1)
    xr, gr = x.detach().clone().requires_grad_(True), gamma.detach().clone().requires_grad_(True)
    want = torch.autograd.grad(torch.ops.npu.npu_swiglu(torch.ops.npu.npu_rms_norm(xr, gr)[0], -1).sum(), (xr, gr))
    for got, exp in zip(sink.backward("NPU.npu_rms_norm.0").grad_input.tree, want):
        assert torch.equal(got, exp)


def test_training_with_npu_ops_through_a_real_server(reports):
    out = reports["out"]
    for rank, mode in ((1, "ops"), (2, "module")):
        info = reports["runs"][mode]
        counts = info["counts"]
        assert counts["unacknowledged"] == 0 and counts["dropped"] == 0 and counts["rejected"] == 0, counts
        # torch_npu is loaded only where it exists (the stand-in module), never imported otherwise
        assert info["torch_npu_loaded"] is (mode == "module")
        if mode == "module":
            assert info["classified"] == ["NPU", "npu_rms_norm"]
        results = read_csv(out, "accuracy_checking_result", rank)
        assert len(results) == counts["forward_calls"], (mode, len(results), counts)
        precision = read_csv(out, "api_precision_compare_result", rank)
        assert len(precision) == len(results)
        for step in ("0", "1"):
            rows = by_name([r for r in results if r["Step"] == step])
            prows = by_name([r for r in precision if r["Step"] == step], "API Name")
            for name in ("NPU.npu_rms_norm.0", "NPU.npu_swiglu.0"):
                assert rows[name]["Forward Test Success"] == "pass", (mode, step, rows[name])
                assert rows[name]["Backward Test Success"] == "pass", (mode, step, rows[name])
                assert prows[name]["Forward Test Success"] == "pass", (mode, step, prows[name])
                assert prows[name]["Backward Test Success"] == "pass", (mode, step, prows[name])
        assert not [r for r in results if "error" in (r["Forward Test Success"], r["Backward Test Success"])]
        details = {r["API Name"] for r in read_csv(out, "accuracy_checking_details", rank)}
        assert {"NPU.npu_rms_norm.0.backward.output.0", "NPU.npu_rms_norm.0.backward.output.1",
                "NPU.npu_swiglu.0.backward.output.0"} <= details
