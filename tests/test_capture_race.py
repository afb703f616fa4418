"""No capture race for tensors written by calls the mode does not see as in-place by name (issue 22).

A record holds references (copy on write, npu_agent/snapshot.py); the sink here is the slowest possible sender: it
keeps the records and encodes them only after the write. A call that writes a tensor held that way must first give
the record its copy: an `out=` argument, a registered operator whose schema marks an argument as written
(`Tensor(a!)`), a torch.distributed collective or receive (these do not even move the tensor's `_version`).
"""
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support import capture, to_job


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_out_argument_after_capture_does_not_change_what_is_sent():
    a, b = torch.randn(5), torch.randn(5)
    with capture() as (mode, sink):
        with mode:
            t = torch.zeros(5)
            torch.add(a, b, out=t)                     # writes the tensor the zeros record holds
            u = torch.ones(5)
            torch.ops.aten.mul.out(a, b, out=u)        # an aten overload
            v, i = torch.full((5,), 2.0), torch.arange(5)
            torch.ops.aten.max.dim_max(torch.stack([a, b]), 0, max=v, max_values=i)   # out arguments not named out
            w = torch.full((5,), 4.0)
            torch._add_relu(a, b, out=w)               # a private torch function: not an API, still a write
    assert torch.equal(t, a + b) and torch.equal(u, a * b) and torch.equal(w, torch.relu(a + b))
    for name, want in (("Torch.zeros.0", torch.zeros(5)), ("Torch.ones.0", torch.ones(5)),
                       ("Torch.full.0", torch.full((5,), 2.0)), ("Torch.arange.0", torch.arange(5)),
                       ("Torch.full.1", torch.full((5,), 4.0))):
        job = to_job(sink.forward(name))
        assert not job.skip_reason, (name, job.skip_reason)
        assert _same(job.output, want), (name, job.output)
    add = to_job(sink.forward("Torch.add.0"))
    assert not add.skip_reason and _same(add.output, a + b)


_LIB = None


def _custom_ops() -> None:
    """Two operators outside aten: `race_test::overwrite(Tensor(a!) dst, Tensor src) -> ()` (raw torch.library) and
    `race_test::scale_(Tensor(a!) x, float s) -> ()` (torch.library.custom_op with mutates_args)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("race_test", "DEF")
    lib.define("overwrite(Tensor(a!) dst, Tensor src) -> ()")

    def overwrite(dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(src)     # under the op's kernel: the mode is not involved

    lib.impl("overwrite", overwrite, "CompositeExplicitAutograd")

    @torch.library.custom_op("race_test::scale_", mutates_args=("x",))
    def scale_(x: torch.Tensor, s: float) -> None:
        x.mul_(s)

    _LIB = (lib, scale_)


def test_operator_with_a_mutable_schema_argument_after_capture_does_not_change_what_is_sent():
    _custom_ops()
    src = torch.arange(6.0)
    with capture() as (mode, sink):
        with mode:
            t = torch.zeros(6)
            torch.ops.race_test.overwrite(t, src)            # the packet
            u = torch.ones(6)
            torch.ops.race_test.overwrite.default(u, src)    # the overload
            w = torch.full((6,), 3.0)
            torch.ops.race_test.scale_(w, 2.0)
    assert torch.equal(t, src) and torch.equal(u, src) and torch.equal(w, torch.full((6,), 6.0))
    for name, want in (("Torch.zeros.0", torch.zeros(6)), ("Torch.ones.0", torch.ones(6)),
                       ("Torch.full.0", torch.full((6,), 3.0))):
        job = to_job(sink.forward(name))
        assert not job.skip_reason, (name, job.skip_reason)
        assert _same(job.output, want), (name, job.output)


# -- torch.distributed, gloo, two ranks --------------------------------------------------------------------------
_ROUNDS = 5


def _rank_main(rank: int, init_file: str, result_dir: str) -> None:
    """One rank: capture creations, then let collectives write the created tensors; only then encode the records
    (the sender is as slow as it can be). Writes `ok` or the failure to result_dir/<rank>."""
    try:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
        other = 1 - rank
        want: dict[str, torch.Tensor] = {}
        # made before capture: what the collectives read, and the values the records must hold (a call inside the
        # mode would shift the names)
        mine, five = torch.full((3,), float(rank + 1)), torch.full((2,), 5.0 + rank)
        sevens, nines, elevens, thirteens = (torch.full(shape, v) for shape, v in
                                             (((2,), 7.0), ((4,), 9.0), ((4,), 11.0), ((2, 2), 13.0)))
        ones22 = torch.ones(2, 2)
        zeros, ones2, minus1, arange2, lin, eye, minus3, tril, triu, diag = (
            torch.zeros(4), torch.ones(2), torch.full((4,), -1.0), torch.arange(2.0), torch.linspace(0, 1, 4),
            torch.eye(2), torch.full((2, 2), -3.0), torch.tril(torch.ones(2, 2)), torch.triu(torch.ones(2, 2)),
            torch.diag(torch.ones(2)))
        with capture() as (mode, sink):
            with mode:
                for r in range(_ROUNDS):
                    t = torch.zeros(4)                       # the case of the issue: zeros, then broadcast
                    if rank == 0:
                        t.fill_(r + 1)                       # seen in place: copied on write already
                    dist.broadcast(t, src=0)
                    want[f"Torch.zeros.{r}"] = zeros
                    assert t.tolist() == [float(r + 1)] * 4
                    s = mine.clone()                         # Tensor.clone: all_reduce writes it on every rank
                    dist.all_reduce(s)
                    want[f"Tensor.clone.{r}"] = mine
                    gathered = [torch.ones(2) for _ in range(2)]      # Torch.ones.{2r}, {2r+1}: all_gather's list
                    dist.all_gather(gathered, five)
                    want[f"Torch.ones.{2 * r}"] = want[f"Torch.ones.{2 * r + 1}"] = ones2
                    big = torch.full((4,), -1.0)                      # Torch.full: all_gather_into_tensor's output
                    dist.all_gather_into_tensor(big, sevens)
                    want[f"Torch.full.{2 * r}"] = minus1
                    rs = torch.arange(2.0)                            # Torch.arange: reduce_scatter_tensor's output
                    dist.reduce_scatter_tensor(rs, nines)
                    want[f"Torch.arange.{r}"] = arange2
                    a2a = torch.linspace(0, 1, 4)                    # Torch.linspace: all_to_all_single's output
                    dist.all_to_all_single(a2a, elevens)
                    want[f"Torch.linspace.{r}"] = lin
                    got = torch.eye(2)                               # Torch.eye: received into (recv / irecv)
                    if rank == 0:
                        dist.send(thirteens, dst=other)
                        dist.irecv(got, src=other).wait()
                    else:
                        dist.recv(got, src=other)
                        dist.isend(thirteens, dst=other).wait()
                    assert torch.equal(got, thirteens)
                    want[f"Torch.eye.{r}"] = eye
                    pair = torch.full((2, 2), -3.0)                  # Torch.full.{2r+1}: a batch_isend_irecv receive
                    ops = [dist.P2POp(dist.isend, thirteens, other), dist.P2POp(dist.irecv, pair, other)]
                    for work in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
                        work.wait()
                    assert torch.equal(pair, thirteens)
                    want[f"Torch.full.{2 * r + 1}"] = minus3
                    red = torch.tril(ones22)                        # Torch.tril: reduce's tensor (dst 0: the sum)
                    dist.reduce(red, dst=0)
                    if rank == 0:
                        want[f"Torch.tril.{r}"] = tril
                    sc = torch.triu(ones22)                         # Torch.triu: scatter's output
                    dist.scatter(sc, [thirteens, thirteens] if rank == 0 else None, src=0)
                    want[f"Torch.triu.{r}"] = triu
                    if rank == 1:                                    # Torch.diag.{2r}, {2r+1}: gather's list
                        gl = [torch.diag(ones2) for _ in range(2)]
                        dist.gather(thirteens, gl, dst=1)
                        want[f"Torch.diag.{2 * r}"] = want[f"Torch.diag.{2 * r + 1}"] = diag
                    else:
                        dist.gather(thirteens, None, dst=1)
        bad = []
        for name, value in want.items():
            job = to_job(sink.forward(name), rank=rank)
            if job.skip_reason or not _same(job.output, value):
                bad.append(f"{name}: skip={job.skip_reason!r} output={job.output}")
        dist.barrier()
        dist.destroy_process_group()
        msg = "ok" if not bad else "\n".join(bad)
    except BaseException:   # noqa: BLE001 - reported to the parent through the result file
        msg = traceback.format_exc()
    with open(os.path.join(result_dir, str(rank)), "w") as fh:
        fh.write(msg)


@pytest.mark.timeout(120)
def test_collectives_and_receives_after_capture_do_not_change_what_is_sent():
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank_main, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=False,
                                 start_method="spawn")
        deadline_s = 90.0
        import time
        end = time.monotonic() + deadline_s
        while not ctx.join(timeout=1):
            if time.monotonic() > end:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail(f"the two gloo ranks did not finish within {deadline_s} s")
        results = {}
        for rank in range(2):
            with open(os.path.join(tmp, str(rank))) as fh:
                results[rank] = fh.read()
    assert results == {0: "ok", 1: "ok"}, "\n".join(f"rank {r}:\n{m}" for r, m in results.items())
