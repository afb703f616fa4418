"""fp8 tensors end to end (issue 23): captured, encoded, decoded bit for bit, and handed to the server's metrics."""
import pytest
import torch

from gpu_server.intake.budget import PEAK_FACTORS
from gpu_server.judging import metrics
from gpu_server.replay.run import run_forward
from npu_agent.records import PendingRecord
from npu_agent.snapshot import HELD, snapshot
from protos import codec
from tests.support import capture, to_job

CPU = torch.device("cpu")
FP8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
       if hasattr(torch, n)]
NS = "ocheck_fp8_test"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    """All 256 bit patterns: both zeros, subnormals, +-max, NaN (and e5m2's infinities) among them."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).reshape(16, 16)


def _extremes(dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    values = [fi.max, -fi.max, fi.tiny, -fi.tiny, fi.smallest_normal, fi.eps, 0.0, 1.0]
    t = torch.tensor(values, dtype=torch.float32).to(dtype)
    nan = torch.tensor([float("nan")]).to(dtype)
    return torch.cat([t, nan])


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_codec_tables_know_fp8(dtype):
    name = str(dtype).removeprefix("torch.")
    assert codec.dtype_name(dtype) == name and codec.dtype_from_name(name) is dtype
    assert dtype.itemsize == 1 and torch.empty(0, dtype=dtype).element_size() == 1
    assert name in PEAK_FACTORS   # the server's memory estimate has a factor for it


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_every_bit_pattern_round_trips(dtype):
    x = _every_value(dtype)
    ext = _extremes(dtype)
    fi = torch.finfo(dtype)
    assert ext[0].float() == fi.max and ext[1].float() == -fi.max and torch.isnan(ext[-1].float())
    strided = x.t()[::2]                      # a non-contiguous view
    rec = PendingRecord(name="Tensor.clone.0", step=0)
    rec.inputs = snapshot(((x, ext, strided), {}))
    copied = snapshot((x, strided), copy=True)   # the inputs of a call that writes them: clones
    rec.output = copied
    job = to_job(rec)
    got_x, got_ext, got_strided = job.args
    for got, want in ((got_x, x), (got_ext, ext), (got_strided, strided), (job.output[0], x),
                      (job.output[1], strided)):
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(_bits(got), _bits(want))   # bit for bit, NaN payloads and -0 included
    assert got_strided.stride() == strided.t().contiguous().t().stride() or got_strided.is_contiguous()


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_copy_on_write_of_a_held_fp8_tensor(dtype):
    x = _every_value(dtype).clone()
    want = _bits(x).clone()
    rec = PendingRecord(name="Tensor.clone.0", step=0)
    rec.inputs = snapshot(((x,), {}))
    assert HELD.protect([x]) >= 1            # a write is about to happen: the record takes its copy
    x.view(torch.uint8).zero_()
    assert torch.equal(_bits(to_job(rec).args[0]), want)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_to_float32_goes_through_the_server(dtype):
    x = _every_value(dtype)
    finite = x[~torch.isnan(x.float()) & ~torch.isinf(x.float())]
    with capture(backward=False) as (mode, sink):
        with mode:
            y = finite.to(torch.float32)
            z = finite.float()
    for name, out in (("Tensor.to.0", y), ("Tensor.float.0", z)):
        job = to_job(sink.forward(name))
        assert job.args[0].dtype == dtype and torch.equal(_bits(job.args[0]), _bits(finite))
        assert torch.equal(job.output, out)
        assert job.skip_reason == ""
        bench = run_forward(job, CPU, bench=True)
        same = run_forward(job, CPU, bench=False)
        assert torch.equal(same, out)
        result = metrics.analyse(bench, job.output)
        assert result.metrics.max_abs_err == 0 and result.metrics.binary_error_rate == 0


@torch.library.custom_op(f"{NS}::scaled_mm", mutates_args=())
def fp8_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)


@fp8_scaled_mm.register_fake
def _fake(a, b, scale_a, scale_b):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)


def test_custom_fp8_matmul_record_carries_its_fp8_inputs():
    # torch._scaled_mm runs on the CPU (torch 2.13); it is a private torch function, not an API the agent records,
    # so a training's fp8 GEMM wrapper (a custom operator) is what carries the fp8 tensors here
    torch.manual_seed(0)
    a = (torch.randn(16, 32) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(8, 32) * 4).to(torch.float8_e5m2)
    sa, sb = torch.tensor(0.5), torch.tensor(2.0)
    with capture(backward=False) as (mode, sink):
        with mode:
            out = fp8_scaled_mm(a, b, sa, sb)
    torch.testing.assert_close(out, a.float() @ b.float().t(), rtol=1e-5, atol=1e-3)
    job = to_job(sink.forward(f"Custom.{NS}.scaled_mm.0"))
    assert [t.dtype for t in job.args[:2]] == [torch.float8_e4m3fn, torch.float8_e5m2]
    assert torch.equal(_bits(job.args[0]), _bits(a)) and torch.equal(_bits(job.args[1]), _bits(b))
    assert torch.equal(job.output, out)


@pytest.mark.parametrize("dtype", FP8[:2], ids=str)
def test_fp8_output_decoded_and_replayed_same_dtype(dtype):
    src = torch.cat([torch.randn(64) * 100, torch.tensor([1e9, -1e9, 1e-9])])
    with capture(backward=False) as (mode, sink):
        with mode:
            y = src.to(dtype)
    job = to_job(sink.forward("Tensor.to.0"))
    assert job.output.dtype == dtype and torch.equal(_bits(job.output), _bits(y))
    assert torch.equal(_bits(run_forward(job, CPU, bench=False)), _bits(y))


@pytest.mark.parametrize("dtype", FP8[:2], ids=str)
def test_metrics_of_an_fp8_device_output(dtype):
    bench = torch.cat([torch.randn(64) * 10, torch.tensor([0.0, 1.0])])
    device = bench.to(dtype)
    result = metrics.analyse(bench, device)
    want = (device.float() - bench).abs().max().item()
    assert result.metrics.max_abs_err == pytest.approx(want)
    assert result.metrics.cosine == pytest.approx(1.0, abs=0.01)   # 2-3 mantissa bits


@pytest.mark.parametrize("dtype", FP8[:2], ids=str)
def test_an_fp8_api_is_replayed_with_a_float32_bench_and_judged(dtype):
    """An API on fp8 tensors giving fp8 (mul): the bench runs in float32 (most CPU kernels do not take one-byte
    floats), the same-dtype run in fp8; the correct device output passes the standards, one flipped to the next
    fp8 value is within the mixed tolerance (rtol 2 eps), three values away in a quarter of its elements fails it."""
    from gpu_server.judging.output_kind import classify
    from gpu_server.judging.standards.judging import judge_pair
    from gpu_server.statuses import ERROR, PASS

    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(256, generator=gen).to(dtype) for _ in range(2))
    with capture(backward=False) as (mode, sink):
        with mode:
            z = torch.mul(x, y)
    job = to_job(sink.forward("Torch.mul.0"))
    bench = run_forward(job, CPU, bench=True)
    same = run_forward(job, CPU, bench=False)
    assert bench.dtype == torch.float32 and same.dtype == dtype
    assert judge_pair("mul", classify(bench, z), same, category="Torch").status == PASS
    near, bad = z.view(torch.uint8).clone(), z.view(torch.uint8).clone()
    near[::4] += 1   # the next representable value (same sign, finite for these magnitudes)
    bad[::4] += 3
    assert judge_pair("mul", classify(bench, near.view(dtype)), same, category="Torch").status == PASS
    assert judge_pair("mul", classify(bench, bad.view(dtype)), same, category="Torch").status == ERROR
