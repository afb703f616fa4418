"""Custom operators (issue 23): every call of a `torch.library` operator of a custom namespace is a record
`Custom.<namespace>.<op>.n` (api `<namespace>.<op>`), sent whole; the server says SKIP until its extension file
gives a reference."""
import torch
import torch.nn.functional as F

from gpu_server.replay import registry
from npu_agent import naming
from npu_agent.capture import written_tensors
from protos import apis
from protos.limits import CALL_NAME, valid_call_name
from tests.support import capture, to_job

NS = "ocheck_custom_test"   # torch.library namespaces are process-wide: one no other test file uses


@torch.library.custom_op(f"{NS}::fused_gelu", mutates_args=())
def fused_gelu(x: torch.Tensor, scale: float) -> torch.Tensor:
    return F.gelu(x) * scale


@fused_gelu.register_fake
def _fused_gelu_fake(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _gelu_grad(x: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1 + torch.erf(x / 2 ** 0.5))
    return cdf + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5


def _backward(ctx, grad: torch.Tensor):
    (x,) = ctx.saved_tensors
    return grad * ctx.scale * _gelu_grad(x), None


fused_gelu.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(f"{NS}::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    out.copy_(x * scale)


# An operator defined by schema, with two overloads (as C++ extensions register theirs)
_LIB = torch.library.Library(NS, "DEF")
_LIB.define("shift(Tensor x, float s) -> Tensor")
_LIB.define("shift.int(Tensor x, int s) -> Tensor")
_LIB.impl("shift", lambda x, s: x + s, "CompositeExplicitAutograd")
_LIB.impl("shift.int", lambda x, s: x + s, "CompositeExplicitAutograd")

REASON = (f"not replayable: no reference for the custom operator {NS}::fused_gelu; give one in the server's "
          "extension file (docs/extensions.md)")


def test_custom_op_in_a_training_is_recorded_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = torch.randn(4, 8), torch.randn(4, 4)
    with capture() as (mode, sink):
        with mode:
            h = model[0](x)
            a = fused_gelu(h, 2.0)                           # the Python wrapper (CustomOpDef.__call__)
            b = torch.ops.ocheck_custom_test.fused_gelu(h, 0.5)   # the packet
            y = model[1](a + b)
            loss = F.mse_loss(y, target)
            loss.backward()
        opt.step()
    names = sink.names()
    custom = [n for n in names if n.startswith("Custom.")]
    assert custom == [f"Custom.{NS}.fused_gelu.0", f"Custom.{NS}.fused_gelu.1"]   # each call exactly once

    rec = sink.forward(f"Custom.{NS}.fused_gelu.0")
    assert rec.skip_reason == "" and rec.inputs is not None   # the agent sends the whole record
    assert rec.backward_expected
    job = to_job(rec)
    assert (job.category, job.api, job.name) == ("Custom", f"{NS}.fused_gelu", f"Custom.{NS}.fused_gelu.0")
    assert torch.equal(job.args[0], h.detach()) and job.args[1] == 2.0 and job.kwargs == {}
    assert torch.equal(job.output, a.detach())
    assert torch.equal(to_job(sink.forward(f"Custom.{NS}.fused_gelu.1")).output, b.detach())

    # backward through the op's register_autograd: the taps catch its gradients like any API's
    bwd = to_job(sink.backward(f"Custom.{NS}.fused_gelu.0"))
    assert bwd.category == "Custom" and bwd.api == f"{NS}.fused_gelu"
    grad_out = bwd.grad_output[0]
    assert grad_out.shape == a.shape
    assert bwd.grad_input_positions == (0,)
    torch.testing.assert_close(bwd.grad_input[0], grad_out * 2.0 * _gelu_grad(h.detach()))

    # the server: SKIP with the reason, by name and with the decoded arguments
    assert apis.replayable(job.category, job.api, job.args, job.kwargs) == REASON
    assert apis.replayable("Custom", f"{NS}.fused_gelu") == REASON
    assert registry.replayable(job.category, job.api, job.args, job.kwargs) == REASON


def test_overloads_and_packets_share_one_api():
    x = torch.randn(3)
    with capture(backward=False) as (mode, sink):
        with mode:
            torch.ops.ocheck_custom_test.shift(x, 1.5)            # packet: the float overload
            torch.ops.ocheck_custom_test.shift.default(x, 2.5)
            torch.ops.ocheck_custom_test.shift.int(x, 3)          # another overload: the same api
    assert sink.names() == [f"Custom.{NS}.shift.{i}" for i in range(3)]
    jobs = [to_job(r) for r in sink]
    assert [j.args[1] for j in jobs] == [1.5, 2.5, 3]
    assert all(torch.equal(j.output, x + j.args[1]) for j in jobs)
    assert naming.classify(torch.ops.ocheck_custom_test.shift.int) == ("Custom", f"{NS}.shift")


def test_mutating_custom_op_keeps_the_values_records_hold():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with capture(backward=False) as (mode, sink):
        with mode, torch.no_grad():
            y = lin(x)                       # held by reference
            before = y.clone()
            scale_into(x, y, 3.0)            # writes y: Tensor(a!) out
    lin_rec = to_job(sink.forward("Functional.linear.0"))
    assert torch.equal(lin_rec.output, before)   # copied before the write
    rec = sink.forward(f"Custom.{NS}.scale_into.0")
    job = to_job(rec)
    assert torch.equal(job.args[1], before)     # its own input: the value before the call
    assert torch.equal(y, x * 3.0)
    assert job.output is None
    written = written_tensors(torch.ops.ocheck_custom_test.scale_into.default, "Custom",
                              f"{NS}.scale_into", (x, y, 3.0), {})
    assert len(written) == 1 and written[0] is y


def test_call_names_accept_one_dot_for_custom_only():
    m = valid_call_name("Custom.mylib.fused_gelu.0")
    assert m is not None and m.groups() == ("Custom", "mylib.fused_gelu", "0")
    m = valid_call_name("Functional.linear.12")
    assert m is not None and (m.group(1), m.group(2)) == ("Functional", "linear")
    for bad in ("Custom.fused_gelu.0", "Custom.a.b.c.0", "Custom..b.0", "Custom.a..0", "Custom.a.9b.0",
                "Functional.a.b.0", "Aten.mul.Tensor.0", "Torch.mylib.x.1", "Custom.mylib.fused_gelu.0\n",
                "Custom.mylib.fused gelu.0", "Xustom.a.b.0", "Custom.a.b.x"):
        assert valid_call_name(bad) is None, bad
    assert CALL_NAME.match("Custom." + "a" * 128 + "." + "b" * 128 + ".0") is not None
    assert valid_call_name("Custom." + "a" * 128 + "." + "b" * 128 + ".0") is None   # longer than max_name_len
    # what the agent names a custom call is what the wire accepts, and `list` entries match it
    c = naming.Counters()
    name = c.next_name(*naming.classify(torch.ops.ocheck_custom_test.fused_gelu))
    assert valid_call_name(name) is not None
    assert all(naming.matches_list(name, (e,)) for e in (name, f"Custom.{NS}.fused_gelu", f"{NS}.fused_gelu"))
    assert not naming.matches_list(name, ("fused_gelu",))


def test_aten_npu_and_torch_namespaces_are_not_custom():
    assert naming.classify(torch.ops.aten.add.Tensor) == ("Aten", "add")
    assert naming.classify(torch.ops.profiler._record_function_enter_new) is None
    assert naming.classify(torch.ops.quantized.add) is None   # torch's own kernels
    assert naming.classify(fused_gelu._opoverload) == ("Custom", f"{NS}.fused_gelu")
    for category, api in (("Functional", "linear"), ("Aten", "add")):   # the others keep their reasons
        assert apis.replayable(category, api) is None
    assert "unknown API category" in apis.replayable("Nope", "x")
