"""Replaying one recorded call on the bench device (SPEC §5.2).

- bench run: floating inputs upcast (float16/bfloat16 -> float32, float32 -> float64; a call that mixes
  float16/bfloat16 with float32 runs all of them in float32), never under autocast;
- same-dtype run: the inputs in their recorded dtypes, under the recorded autocast state (the noise floor);
- a call recorded under autocast is replayed so the bench sees the inputs the device computed with;
- dropout is replayed with the recorded keep-mask, other random APIs with the recorded generator state on the same
  device type only; in-place APIs act on private copies (every replay gets its own copies).

`ReplayError` carries the reason a call cannot be replayed; it becomes a SKIP row.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from gpu_server.intake import Job
from gpu_server.registry import UnknownApi, resolve
from protos.codec import Opaque, dtype_from_name
from protos.trees import iter_leaves, map_leaves

LOW = (torch.float16, torch.bfloat16)


class ReplayError(Exception):
    """The call cannot be replayed here; str() is the reason for the SKIP row."""


def flatten_outputs(out: Any) -> list:
    """The compared leaves of an output, in order: tensors and Python numbers (None entries are not compared)."""
    return [v for v in iter_leaves(out) if v is not None]


def upcast_plan(tensors: list[torch.Tensor]) -> dict[torch.dtype, torch.dtype]:
    floats = {t.dtype for t in tensors if t.is_floating_point()}
    if floats & set(LOW) and torch.float32 in floats:
        return {torch.float16: torch.float32, torch.bfloat16: torch.float32}
    return {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def _opaque_check(job: Job) -> None:
    for leaf in iter_leaves((job.args, job.kwargs)):
        if isinstance(leaf, Opaque) and not leaf.type_name.startswith("device "):
            raise ReplayError(f"an argument of type {leaf.type_name} cannot cross the wire, so the call cannot be "
                              "replayed")


def _autocast_dtype(job: Job) -> torch.dtype | None:
    enabled, name, _ = job.autocast
    if not enabled or not name:
        return None
    return dtype_from_name(name)


def _autocast_precast(job: Job) -> torch.dtype | None:
    """The dtype autocast cast this call's float32 inputs to, judged from the recorded output: autocast ran the
    call in low precision when a floating output has the autocast dtype while float32 went in."""
    ac = _autocast_dtype(job)
    if ac is None:
        return None
    outs = [t for t in iter_leaves(job.output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    ins = [t for t in iter_leaves((job.args, job.kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if outs and all(t.dtype == ac for t in outs) and any(t.dtype == torch.float32 for t in ins):
        return ac
    return None


def prepare_inputs(job: Job, device: torch.device, bench: bool, requires_grad: bool = False):
    """Private copies of the call's inputs on `device`: upcast for the bench run, as recorded for the same-dtype
    run. With `requires_grad`, the float tensors that required grad in training become leaves that require grad
    (returned in `leaves`, by position in the flattened inputs)."""
    _opaque_check(job)
    precast = _autocast_precast(job) if bench else None
    tensors = [t for t in iter_leaves((job.args, job.kwargs)) if isinstance(t, torch.Tensor)]
    if precast is not None:
        tensors = [t.to(precast) if t.dtype == torch.float32 else t for t in tensors]
    plan = upcast_plan(tensors) if bench else {}
    leaves: dict[int, torch.Tensor] = {}
    position = 0

    def move(leaf):
        nonlocal position
        if isinstance(leaf, torch.Tensor):
            index = position
            position += 1
            t = leaf
            if precast is not None and t.dtype == torch.float32:
                t = t.to(precast)
            t = t.to(device=device, dtype=plan.get(t.dtype, t.dtype), copy=True)
            if requires_grad and id(leaf) in job.requires_grad and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
                leaves[index] = t
            return t
        if isinstance(leaf, torch.device) or (isinstance(leaf, Opaque) and leaf.type_name.startswith("device ")):
            return device
        return leaf

    args = map_leaves(job.args, move)
    kwargs = map_leaves(job.kwargs, move)
    return args, kwargs, leaves


@contextlib.contextmanager
def _rng(job: Job, device: torch.device):
    """Replay a random API from its recorded generator state, on the same device type only."""
    if not job.rng_state or job.mask is not None:
        yield
        return
    if job.rng_device != device.type:
        raise ReplayError(f"random API recorded on {job.rng_device}; its generator state can be replayed only on the "
                          f"same device type, and this bench device is {device.type}")
    state = torch.frombuffer(bytearray(job.rng_state), dtype=torch.uint8)
    saved = torch.get_rng_state() if device.type == "cpu" else getattr(torch, device.type).get_rng_state()
    setter = torch.set_rng_state if device.type == "cpu" else getattr(torch, device.type).set_rng_state
    try:
        setter(state)
    except RuntimeError as exc:
        raise ReplayError(f"the recorded generator state does not fit this host's generator: {exc}") from None
    try:
        yield
    finally:
        setter(saved)


def _masked_dropout(job: Job, args: tuple, kwargs: dict) -> torch.Tensor:
    """Dropout with the recorded keep-mask, computed as torch's kernel does: x * (mask / (1 - p))."""
    x = args[0]
    if job.category == "Functional":
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    else:
        p = args[1] if len(args) > 1 else kwargs.get("p")
    mask = job.mask.to(x.device)
    if tuple(mask.shape) != tuple(x.shape):
        raise ReplayError(f"dropout mask shape {tuple(mask.shape)} does not match the input {tuple(x.shape)}")
    if p >= 1:
        return x * torch.zeros_like(x)
    scale = mask.to(x.dtype).div_(1 - p)
    if job.inplace or kwargs.get("inplace") or (len(args) > 3 and args[3] is True):
        return x.mul_(scale)
    return x * scale


def call_api(job: Job, args: tuple, kwargs: dict, device: torch.device) -> Any:
    if job.mask is not None:
        return _masked_dropout(job, args, kwargs)
    try:
        fn = resolve(job.category, job.api)
    except UnknownApi as exc:
        raise ReplayError(str(exc)) from None
    with _rng(job, device):
        out = fn(*args, **kwargs)
    if out is None and job.inplace and args and isinstance(args[0], torch.Tensor):
        return args[0]  # `x[i] = v`: what the call produced is the new x
    return out


@contextlib.contextmanager
def _threads(job: Job, device: torch.device, bench: bool, match: bool = True):
    """A CPU same-dtype run uses the training's intra-op thread count: low-precision CPU kernels reduce in
    thread-sized blocks, and the noise floor should be what the same configuration computes."""
    n = job.intra_op_threads
    if bench or not match or device.type != "cpu" or n <= 0 or n == torch.get_num_threads():
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def run_forward(job: Job, device: torch.device, bench: bool, match_threads: bool = True) -> Any:
    """One forward replay: the bench run (bench=True) or the same-dtype run. Exceptions -> ReplayError.
    `match_threads=False`: never change torch's thread count (several CPU workers share it)."""
    args, kwargs, _ = prepare_inputs(job, device, bench)
    ac = None if bench else _autocast_dtype(job)
    try:
        with torch.no_grad(), _threads(job, device, bench, match_threads), _autocast(device, ac):
            return call_api(job, args, kwargs, device)
    except ReplayError:
        raise
    except Exception as exc:  # noqa: BLE001 - the replay failing is a reported outcome, not a crash
        raise ReplayError(f"replay failed with {type(exc).__name__}: {str(exc)[:300]}") from None


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast to `dtype` (the recorded state of a same-dtype run), or autocast off (the bench run, and calls
    recorded without it), whatever the caller's thread had on."""
    if dtype:
        ctx = torch.autocast(device.type, dtype=dtype, enabled=True)   # unsupported here: the replay fails, said
    else:
        try:
            ctx = torch.autocast(device.type, enabled=False)
        except RuntimeError:  # a device type without autocast has nothing to turn off
            ctx = contextlib.nullcontext()
    with ctx:
        yield


def run_backward(fwd: Job, bwd: Job, device: torch.device, bench: bool, match_threads: bool = True) -> list:
    """Replay the call with autograd and feed the recorded grad_output (upcast for the bench run) into
    `torch.autograd.backward`. Returns one gradient (or None) per entry of the backward record's grad_input."""
    args, kwargs, leaves = prepare_inputs(fwd, device, bench, requires_grad=True)
    if not leaves:
        raise ReplayError("no input of this call required grad on the bench host")
    if fwd.inplace:  # an in-place op cannot act on a leaf that requires grad: give it a differentiable copy
        index = {id(t): t for t in leaves.values()}
        args = map_leaves(args, lambda v: v.clone() if isinstance(v, torch.Tensor) and id(v) in index else v)
    ac = None if bench else _autocast_dtype(fwd)
    try:
        with _threads(fwd, device, bench, match_threads):
            return _backward(fwd, bwd, args, kwargs, leaves, device, ac)
    except ReplayError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ReplayError(f"backward replay failed with {type(exc).__name__}: {str(exc)[:300]}") from None


def _backward(fwd: Job, bwd: Job, args, kwargs, leaves: dict, device: torch.device, ac) -> list:
    with torch.enable_grad(), _autocast(device, ac):
        out = call_api(fwd, args, kwargs, device)
    outs = [t for t in iter_leaves(out) if isinstance(t, torch.Tensor)]
    grads = list(bwd.grad_output) if isinstance(bwd.grad_output, (list, tuple)) else [bwd.grad_output]
    if len(grads) != len(outs):
        raise ReplayError(f"backward record has {len(grads)} grad_outputs for {len(outs)} outputs")
    pairs = [(o, g.to(device=device, dtype=o.dtype)) for o, g in zip(outs, grads)
             if isinstance(g, torch.Tensor) and o.requires_grad]
    if not pairs:
        raise ReplayError("no output of the replayed call is differentiable")
    for o, g in pairs:
        if tuple(o.shape) != tuple(g.shape):
            raise ReplayError(f"grad_output shape {tuple(g.shape)} does not match the output {tuple(o.shape)}")
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    result = []
    for pos in bwd.grad_input_positions:
        leaf = leaves.get(pos)
        result.append(None if leaf is None or leaf.grad is None else leaf.grad.detach())
    return result
