"""A 4-rank gloo training that calls every collective the server checks (docs/collectives.md), run by
tests/test_collectives_e2e.py under the agent, one process per rank:

    python collective_training.py AGENT_CONFIG STEPS FAULT FAULT_RANK      (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

- a tensor-parallel MLP in Megatron's style: its input is copied to the ranks with an all_reduce of the gradient in
  the backward pass, its output is the all_reduce of the ranks' partial products (custom autograd Functions);
- data-parallel gradient averaging of a replicated head with all_reduce, the last one async (`Work.wait`);
- FSDP-style reduce_scatter_tensor of the flat gradient and all_gather_into_tensor of the shards;
- broadcast into a tensor made by torch.zeros (the capture race of issue 22), all_gather, reduce, reduce_scatter,
  all_to_all, all_to_all_single with uneven splits, blocking send/recv around a ring and an isend/irecv pair.

FAULT, installed in rank FAULT_RANK's process only, inside the collective where capture cannot see it:
- "reduction": every all_reduce scales this rank's contribution by 1 + 2**-10;
- "recv": every tensor this rank receives has one element's low mantissa bit flipped;
- "mismatch": at step 1 this rank calls all_gather where the others call all_reduce (gloo times out on every rank
  after GLOO_TIMEOUT_S; the training reports it and ends);
- "none": a correct run.
Prints `COUNTS {...}` (the agent's counts) and `CALLS [...]` (the ProcessGroup calls the training made, in order).
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from npu_agent import PrecisionDebugger

cfg, steps, fault, fault_rank = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("GLOO_TIMEOUT_S", "60"))))
rank, world = dist.get_rank(), dist.get_world_size()
D, H = 16, 8 * world

# -- what the training asks of the process group, in order (the agent must not add or reorder any) --------------------
CALLS: list[str] = []
PG = dist.ProcessGroup
for _name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single",
              "reduce_scatter", "reduce_scatter_single", "alltoall", "all_to_all_single", "send", "recv",
              "recv_anysource", "barrier", "gather", "scatter"):
    _orig = getattr(PG, _name)

    def _logged(self, *args, _orig=_orig, _name=_name, **kwargs):
        CALLS.append(_name)
        return _orig(self, *args, **kwargs)

    setattr(PG, _name, _logged)


def install_fault() -> None:
    if rank != fault_rank:
        return
    if fault == "reduction":
        allreduce = PG.allreduce

        def scaled(self, tensors, *args, **kwargs):
            for t in tensors if isinstance(tensors, list) else [tensors]:
                t.mul_(1 + 2 ** -10)   # this rank's contribution, as a faulty backend would send it
            return allreduce(self, tensors, *args, **kwargs)

        PG.allreduce = scaled
    elif fault == "recv":
        from torch._C._distributed_c10d import _create_work_from_future

        recv = PG.recv

        def flipped(self, tensors, *args, **kwargs):
            recv(self, tensors, *args, **kwargs).wait()   # a gloo recv's Work is waited on once only
            bits = tensors[0].view(-1).view(torch.int32)
            bits[1] ^= 1   # one element's lowest mantissa bit
            done = torch.futures.Future()
            done.set_result(tensors)
            return _create_work_from_future(done)

        PG.recv = flipped


class CopyToTensorParallel(torch.autograd.Function):
    """Forward: the input as it is on every rank; backward: the sum of the ranks' input gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: the sum of the ranks' partial outputs; backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class TensorParallelMLP(nn.Module):
    def __init__(self):
        super().__init__()
        full_in, full_out = nn.Linear(D, H), nn.Linear(H, D, bias=False)
        shard = H // world
        rows = slice(rank * shard, (rank + 1) * shard)
        self.w1 = nn.Parameter(full_in.weight.detach()[rows].clone())
        self.b1 = nn.Parameter(full_in.bias.detach()[rows].clone())
        self.w2 = nn.Parameter(full_out.weight.detach()[:, rows].clone())

    def forward(self, x):
        x = CopyToTensorParallel.apply(x)
        h = F.gelu(F.linear(x, self.w1, self.b1))
        return ReduceFromTensorParallel.apply(F.linear(h, self.w2))


torch.manual_seed(0)   # the same initial weights on every rank
pre, tp, head = nn.Linear(D, D), TensorParallelMLP(), nn.Linear(D, 4)
params = list(pre.parameters()) + list(tp.parameters()) + list(head.parameters())
opt = torch.optim.SGD(params, lr=0.05)
install_fault()
dbg = PrecisionDebugger(config_path=cfg)
failed = ""


def step_collectives(step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, D, generator=gen) if rank == 0 else torch.zeros(8, D)
    dist.broadcast(x, src=0)                                  # into torch.zeros on ranks 1-3
    # each rank has its own targets, as data-parallel ranks see different data: their gradients differ
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(2000 + 10 * step + rank))
    loss = F.mse_loss(head(tp(pre(x))), target)
    loss.backward()
    grads = [p.grad for p in list(pre.parameters()) + list(head.parameters())]
    for g in grads[:-1]:                                      # data-parallel averaging, the last one async
        dist.all_reduce(g)
        g.div_(world)
    work = dist.all_reduce(grads[-1], async_op=True)
    flat = torch.cat([p.grad.flatten() for p in tp.parameters()])
    flat = F.pad(flat, (0, (-flat.numel()) % world))
    work.wait()
    grads[-1].div_(world)
    shard = torch.empty(flat.numel() // world)
    dist.reduce_scatter_tensor(shard, flat)                   # FSDP-style
    full = torch.empty_like(flat)
    dist.all_gather_into_tensor(full, shard)
    losses = [torch.empty(1) for _ in range(world)]
    if fault == "mismatch" and step == 1:
        probe = torch.full((8,), float(rank))
        if rank == fault_rank:
            dist.all_gather([torch.empty(8) for _ in range(world)], probe)
        else:
            dist.all_reduce(probe)
    dist.all_gather(losses, loss.detach().reshape(1))
    total = loss.detach().clone()
    dist.reduce(total, dst=0)
    pieces = [torch.full((3,), rank * 10.0 + j) for j in range(world)]
    mine = torch.empty(3)
    dist.reduce_scatter(mine, pieces)
    got = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(got, [torch.full((2,), rank + j / 10) for j in range(world)])
    splits_in = [1 + (rank + j) % 2 for j in range(world)]             # uneven splits
    splits_out = [1 + (j + rank) % 2 for j in range(world)]
    out = torch.empty(sum(splits_out))
    dist.all_to_all_single(out, torch.arange(sum(splits_in), dtype=torch.float32) + 100 * rank, splits_out,
                           splits_in)
    right, left = (rank + 1) % world, (rank - 1) % world
    message, inbox = torch.randn(5, generator=gen) + rank, torch.empty(5)
    if rank % 2 == 0:
        dist.send(message, right)
        dist.recv(inbox, left)
    else:
        dist.recv(inbox, left)
        dist.send(message, right)
    inbox2 = torch.empty(6)
    sent = dist.isend(message.repeat(2)[:6] * 2, right)
    received = dist.irecv(inbox2, left)
    sent.wait()
    received.wait()
    opt.step()
    opt.zero_grad()


for step in range(steps):
    dbg.start()
    try:
        step_collectives(step)
    except RuntimeError as exc:   # a collective called differently on some rank: gloo times out
        failed = str(exc).splitlines()[0][:200]
    dbg.stop()
    dbg.step()
    if failed:
        break
counts = dbg.close() or {}
print("COUNTS " + json.dumps(counts))
print("CALLS " + json.dumps(CALLS))
print("FAILED " + json.dumps(failed))
sys.stdout.flush()
if failed:
    os._exit(0)   # the process group is broken after a timeout: do not wait for it to shut down
dist.destroy_process_group()
