"""Replaying one recorded call on the bench device (docs/design.md §6.4).

- bench run: floating inputs upcast (float16/bfloat16 -> float32, float32 -> float64; a call that mixes
  float16/bfloat16 with float32 runs all of them in float32), never under autocast;
- same-dtype run: the inputs in their recorded dtypes, under the recorded autocast state (the noise floor);
- a call recorded under autocast is replayed so the bench sees the inputs the device computed with;
- random APIs (protos/apis.py): dropout is replayed with the recorded keep-mask; random draws (rand, bernoulli,
  normal_, ...) in the recorded dtype only, from the recorded generator state, and that replay is also the bench
  (a float64 run draws another stream); computations with noise inside (rrelu, alpha_dropout, ...) from the
  recorded generator state in both precisions on a CPU bench (the noise does not depend on the dtype there,
  measured), else against the same-dtype replay; `scaled_dot_product_attention` with dropout recovers the kernel's
  keep-mask from same-dtype replays and computes the bench with it. Always on the recorded device type only;
- uninitialised outputs (`empty`, `empty_like`, ...) are never compared: SKIP;
- a reference from the server's extension file (gpu_server/replay/extensions.py) is replayed like a built-in fused
  reference; one whose meta dry run fails is still run (it is the operator's own, trusted code);
- in-place APIs act on private copies (every replay gets its own copies);
- every device argument (a `torch.device`, or a device string such as 'cpu' or 'npu:0' as `device=` or given to
  `to`/`cuda`) is the bench device in the replay: factories (`torch.tensor(1.0, device='cpu')`, `torch.zeros(3,
  device=...)`) are replayed and compared like any API;
- every replay runs inside `global_state_guard`: a call that changed torch's global state (default dtype or device,
  grad mode, threads, deterministic flags, the default generator, ...) is SKIP and the state is put back;
- before any kernel runs: index arguments are checked against what they index (`gpu_server.replay.native_bounds`), and
the
  bench run's memory is bounded by a meta-device dry run plus the estimates of `gpu_server.replay.memory_bounds`
  (`allocation_check`).

`ReplayError` carries the reason a call cannot be replayed; it becomes a SKIP row.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
from typing import Any, Callable, Iterator

import torch

from gpu_server.job import Job
from gpu_server.replay import extensions, memory_bounds
from gpu_server.replay.native_bounds import index_problem
from gpu_server.replay.registry import UnknownApi, is_device_string, resolve
from protos import apis
from protos.codec import Opaque, dtype_from_name
from protos.rng import generator_state, set_generator_state
from protos.trees import iter_leaves, map_leaves

# Held while a replay reads or temporarily sets process-wide torch state (the default generator): CPU workers share
# it, so a random replay and another worker's state check never interleave.
STATE_LOCK = threading.RLock()
_SDPA_MAX_PROBES = 256

LOW = (torch.float16, torch.bfloat16)


class ReplayError(Exception):
    """The call cannot be replayed here; str() is the reason for the SKIP row."""


def flatten_outputs(out: Any) -> list:
    """The compared leaves of an output, in order: tensors and Python numbers (None entries are not compared)."""
    return [v for v in iter_leaves(out) if v is not None]


def upcast_plan(tensors: list[torch.Tensor]) -> dict[torch.dtype, torch.dtype]:
    floats = {t.dtype for t in tensors if t.is_floating_point()}
    # one-byte floats (float8, the rule gpu_server/judging/metrics.py widens by): most CPU kernels do not take them, so
    # their
    # bench runs in float32 (their rounding is far coarser)
    fp8 = {d: torch.float32 for d in floats if d.itemsize == 1}
    if (floats & set(LOW) or fp8) and torch.float32 in floats:
        return {torch.float16: torch.float32, torch.bfloat16: torch.float32, **fp8}
    return {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64, **fp8}


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
            t = to_device(t, device, plan.get(t.dtype, t.dtype))
            if requires_grad and id(leaf) in job.requires_grad and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
                leaves[index] = t
            return t
        if isinstance(leaf, torch.device) or (isinstance(leaf, Opaque) and leaf.type_name.startswith("device ")):
            return device
        if is_device_string(job.api, leaf):
            return device
        return leaf

    args = map_leaves(job.args, move)
    kwargs = device_kwargs(job.api, map_leaves(job.kwargs, move), device)
    return args, kwargs, leaves


def device_kwargs(api: str, kwargs: dict, device: torch.device) -> dict:
    """`kwargs` with a device string given as `device=` ('cpu', 'npu:0': protos/apis.is_device_string) replaced by
    `device`: `torch.tensor(1.0, device='cpu')` is replayed on the bench device like any factory."""
    if any(is_device_string(api, v, k) for k, v in kwargs.items()):
        return {k: device if is_device_string(api, v, k) else v for k, v in kwargs.items()}
    return kwargs


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A private copy of `t` on `device` in `dtype`. Host to CUDA goes through pinned memory without waiting for
    the copy (the ops that read it are queued after it on the same stream) and converts on the GPU."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True).to(dtype)
    return t.to(device=device, dtype=dtype, copy=True)


def _rng_access(device: torch.device) -> tuple[Callable, Callable]:
    """Read and set the default generator of `device`, through the helpers the agent records with (protos/rng.py)."""
    return (lambda: generator_state(device)), (lambda state: set_generator_state(device, state))


@contextlib.contextmanager
def _rng(job: Job, device: torch.device):
    """Run with the default generator of `device` set to the recorded state, then put the server's state back."""
    state = torch.frombuffer(bytearray(job.rng_state), dtype=torch.uint8)
    getter, setter = _rng_access(device)
    with STATE_LOCK:
        saved = getter()
        try:
            setter(state)
        except RuntimeError as exc:
            raise ReplayError(f"the recorded generator state does not fit this host's generator: {exc}") from None
        try:
            yield
        finally:
            setter(saved)


_RANDOM_ADVICE = ("to check this call, run the server on the training's device type, or make the checked steps "
                  "deterministic (seed_all(rm_dropout=True), dropout p=0, model.eval())")


def random_plan(job: Job, device: torch.device) -> str | None:
    """How a random call is replayed: None (not random, or dropout with its recorded keep-mask), "draw" (the
    recorded dtype only), "inside" (both precisions from the generator state), "same" (the bench is the same-dtype
    replay) or "sdpa" (keep-mask recovered from the kernel). ReplayError when the stream cannot be reproduced."""
    kind = apis.random_kind(job.category, job.api, job.args, job.kwargs)
    if kind is None or job.mask is not None:
        return None
    what = f"{job.category}.{job.api} draws random numbers"
    if job.category == "NPU":
        keep = apis.random_arg(job.args, job.kwargs, 9, "keep_prob", 1.0)
        raise ReplayError(f"{job.category}.{job.api} with keep_prob={keep} applies a random dropout mask inside the "
                          "fused NPU kernel (its Philox mask is not recorded and cannot be regenerated on the bench "
                          f"host); {_RANDOM_ADVICE.replace('dropout p=0', 'keep_prob=1')}")
    if not job.rng_state:
        raise ReplayError(f"{what} and its record carries no generator state (the device's generator cannot be read "
                          f"by the agent); {_RANDOM_ADVICE}")
    if job.rng_device != device.type:
        raise ReplayError(f"{what}; its generator state, recorded on {job.rng_device[:32] or 'an unknown device'}, "
                          f"reproduces the stream only on the same device type and this bench device is "
                          f"{device.type}; {_RANDOM_ADVICE}")
    if kind == "draw":
        return "draw"
    if job.api == "scaled_dot_product_attention":
        return "sdpa"
    return "inside" if device.type == "cpu" else "same"


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


def call_api(job: Job, args: tuple, kwargs: dict, device: torch.device, plan: str | None = None,
             keep: torch.Tensor | None = None) -> Any:
    """Call the API on prepared inputs. `plan` (random_plan) says whether to run from the recorded generator state;
    `keep` is the recovered keep-mask of a scaled_dot_product_attention bench run."""
    if job.mask is not None:
        return _masked_dropout(job, args, kwargs)
    if keep is not None:
        return sdpa_reference(*_sdpa_args(args, kwargs), keep=keep)
    try:
        fn = resolve(job.category, job.api)
    except UnknownApi as exc:
        raise ReplayError(str(exc)) from None
    with _rng(job, device) if plan else contextlib.nullcontext():
        out = fn(*args, **kwargs)
    if out is None and job.inplace and args and isinstance(args[0], torch.Tensor):
        return args[0]  # `x[i] = v`: what the call produced is the new x
    return out


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, which a container or taskset narrows)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):   # no affinity API on this platform
        return max(os.cpu_count() or 1, 1)


@contextlib.contextmanager
def _threads(job: Job, device: torch.device, bench: bool, match: bool = True) -> Iterator[None]:
    """A CPU same-dtype run uses the training's intra-op thread count: low-precision CPU kernels reduce in
    thread-sized blocks, and the noise floor should be what the same configuration computes. The count comes off the
    wire: it is capped at the cores this host lets the server use (a record asking for 1,024 threads would otherwise
    start them, and OpenMP keeps its threads)."""
    n = min(job.intra_op_threads, usable_cores())
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
    with global_state_guard(device, f"{job.category}.{job.api}"):
        plan, bench = _checked_plan(job, device, bench)
        args, kwargs, _ = prepare_inputs(job, device, bench)
        ac = None if bench else _autocast_dtype(job)
        try:
            keep = sdpa_keep_mask(job, device, match_threads) if plan == "sdpa" and bench else None
            with torch.no_grad(), _threads(job, device, bench, match_threads), _autocast(device, ac):
                return call_api(job, args, kwargs, device, plan, keep)
        except ReplayError:
            raise
        except Exception as exc:  # noqa: BLE001 - the replay failing is a reported outcome, not a crash
            raise ReplayError(f"replay failed with {type(exc).__name__}: {str(exc)[:300]}") from None


def _checked_plan(job: Job, device: torch.device, bench: bool) -> tuple[str | None, bool]:
    """The checks every replay starts with (uninitialised and opaque inputs, index bounds, and for the bench run the
    allocation), and the random plan: (plan, bench). A random stream is reproduced in the recorded dtype only, so for
    plans "draw" and "same" that replay is the bench too (bench becomes False)."""
    _uninitialised_check(job)
    _opaque_check(job)
    bounds_check(job)
    plan = random_plan(job, device)
    if bench:
        allocation_check(job)
    if plan in ("draw", "same"):
        bench = False
    return plan, bench


def bounds_check(job: Job) -> None:
    """Refuse a call whose index arguments lie outside what they index (gpu_server/replay/native_bounds.py): the intake
    refused such a record already; this is the same check where the replay runs (a worker process, a restart)."""
    why = index_problem(job.category, job.api, job.args, job.kwargs)
    if why is not None:
        raise ReplayError(why)


def allocation_check(job: Job, slack: int = 1 << 16) -> None:
    """Refuse a call whose bench run would need far more memory than the record accounts for, before it runs.

    - Outputs: the call is first run on the meta device, which computes shapes and allocates nothing; a call whose
      outputs would hold more than twice the elements the device produced (plus `slack`) is refused (`zeros(1 <<
      40)`, a huge `repeat` or `scale_factor`). Sizes given as one-element tensors (`zeros(tensor(N))`) are read as
      numbers for a second dry run, boolean index masks as the positions they select
      (gpu_server/replay/memory_bounds.py).
    - A dry run that fails makes the call not replayable, except for the APIs whose output size depends on values
      (`memory_bounds.OUTPUT_ESTIMATES`: bincount, one_hot, repeat_interleave, ...; the estimate takes the dry
      run's place) and those whose memory is bounded by their inputs (`memory_bounds.BOUNDED_BY_INPUTS`).
    - Intermediates far larger than the outputs (a float64 convolution's im2col buffer, mvlgamma's table, ctc_loss's
      alpha table, combinations' masks, einsum's products, ...) are estimated and bounded by
      `memory_bounds.intermediate_allowance` of the record's elements.

    A meta run sees no values, only shapes, dtypes, the other arguments and the value of each one-element tensor,
    so its result is a function of those: it is remembered per call signature (`_META_SIZES`), and a call site met
    again (every step of a training) costs a lookup. The estimates read values and are computed every time."""
    if job.mask is not None:
        return
    what = f"{job.category}.{job.api}"
    recorded = sum(t.numel() for t in iter_leaves(job.output) if isinstance(t, torch.Tensor))
    key = _signature(job)
    dry = _META_SIZES.get(key, _UNKNOWN) if key is not None else _UNKNOWN
    if dry is _UNKNOWN:
        dry = _meta_elements(job)
        if key is not None:
            if len(_META_SIZES) >= _META_SIZES_LIMIT:
                _META_SIZES.clear()
            _META_SIZES[key] = dry
    produced: int | None = dry if isinstance(dry, int) else None
    try:
        if produced is None:
            produced = memory_bounds.output_elements(job.category, job.api, job.args, job.kwargs)
        need = memory_bounds.intermediate_bytes(job.category, job.api, job.args, job.kwargs)
    except Exception as exc:  # noqa: BLE001 - fail closed: a call whose memory cannot be estimated is not run
        raise ReplayError(f"not replayable: the memory a replay of {what} needs could not be estimated "
                          f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if produced is None and job.api not in memory_bounds.BOUNDED_BY_INPUTS and \
            extensions.reference_for(job.category, job.api) is None:   # the operator's own reference: trusted code
        raise ReplayError(f"not replayable: {what} failed its dry run on the meta device ({dry}), so the memory its "
                          "replay would take is unknown; only APIs whose memory is bounded by their inputs are "
                          "replayed without one (docs/security.md)")
    if produced is not None and produced > 2 * recorded + slack:
        raise ReplayError(f"not replayable: replaying {what} would produce {produced} elements "
                          f"where the device produced {recorded}")
    if need is not None:
        nbytes, where = need
        elements = sum(t.numel() for t in iter_leaves((job.args, job.kwargs, job.output))
                       if isinstance(t, torch.Tensor))
        allowed = memory_bounds.intermediate_allowance(elements)
        if nbytes > allowed:
            raise ReplayError(f"not replayable: replaying {what} would need about {_mib(nbytes)} for {where}, more "
                              f"than the {_mib(allowed)} allowed for a record of {elements} tensor elements "
                              "(docs/security.md)")


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.0f} MiB" if nbytes < 1 << 50 else f"{nbytes / (1 << 50):,.0f} PiB"


def _meta_elements(job: Job) -> int | str:
    """The elements of the call's outputs on the meta device, or why the dry run failed (no meta kernel, a
    data-dependent shape, or a call that fails anyway). Tried as recorded, then with one-element tensors read as
    numbers (sizes given as tensors) and boolean index masks as the positions they select."""
    meta = torch.device("meta")

    def to_meta(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.to(meta)
        if isinstance(leaf, torch.device) or (isinstance(leaf, Opaque) and leaf.type_name.startswith("device ")):
            return meta
        return meta if is_device_string(job.api, leaf) else leaf

    try:
        fn = resolve(job.category, job.api)
    except UnknownApi as exc:
        return str(exc)
    args, kwargs = job.args, job.kwargs
    failure = ""
    for attempt in range(2):
        if attempt and not any(isinstance(t, torch.Tensor) and t.numel() == 1 for t in iter_leaves((args, kwargs))):
            break
        try:
            if attempt:
                args, kwargs = memory_bounds.scalar_arguments(job.category, args, kwargs)
            else:
                args, kwargs = memory_bounds.mask_arguments(job.api, args, kwargs)
            meta_args = map_leaves(args, to_meta)
            meta_kwargs = device_kwargs(job.api, map_leaves(kwargs, to_meta), meta)
            with torch.no_grad(), meta:
                out = fn(*meta_args, **meta_kwargs)
            return sum(t.numel() for t in iter_leaves(out) if isinstance(t, torch.Tensor))
        except Exception as exc:  # noqa: BLE001 - no meta kernel, a data-dependent shape, or a call that fails
            failure = failure or f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return failure


_UNKNOWN: Any = object()
_META_SIZES: dict[tuple[Any, ...], int | str] = {}   # call signature -> _meta_elements (dict operations are atomic)
_META_SIZES_LIMIT = 4096
_SCALARS = (bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


class _NoSignature(Exception):
    pass


def _signature(job: Job) -> tuple[Any, ...] | None:
    """What a meta run of the call depends on: the API, and its arguments with each tensor as its shape and
    dtype (a one-element tensor with its value too: it may be read as a size), every other value with its type;
    None for a value that cannot be compared safely, and for indexing with boolean masks (the dry run depends on
    how many positions they select)."""
    if memory_bounds.has_masks(job.api, job.args, job.kwargs):
        return None

    def sig(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if v.numel() == 1:
                try:
                    return ("scalar tensor", tuple(v.shape), v.dtype, v.reshape(()).item())
                except (RuntimeError, TypeError):
                    raise _NoSignature from None
            return ("tensor", tuple(v.shape), v.dtype)
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, tuple(sig(x) for x in v))
        if isinstance(v, dict):
            return ("dict", tuple((k, sig(x)) for k, x in v.items()))
        if isinstance(v, slice):
            return ("slice", sig(v.start), sig(v.stop), sig(v.step))
        if isinstance(v, Opaque):
            return ("opaque", v.type_name)
        if v is None or v is Ellipsis or type(v) in _SCALARS:
            return (type(v).__name__, v)
        raise _NoSignature

    try:
        return (job.category, job.api, sig(job.args), sig(job.kwargs))
    except _NoSignature:
        return None


def _uninitialised_check(job: Job) -> None:
    if apis.uninitialised(job.api):
        raise ReplayError(f"uninitialised output: {job.category}.{job.api} returns memory it did not write; its "
                          "values are whatever was there and are never compared")


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
    with global_state_guard(device, f"{fwd.category}.{fwd.api}"):
        plan, bench, args, kwargs, leaves = _grad_inputs(fwd, device, bench)
        if not leaves:
            raise ReplayError("no input of this call required grad on the bench host")
        ac = None if bench else _autocast_dtype(fwd)
        try:
            keep = sdpa_keep_mask(fwd, device, match_threads) if plan == "sdpa" and bench else None
            with _threads(fwd, device, bench, match_threads):
                with torch.enable_grad(), _autocast(device, ac):
                    out = call_api(fwd, args, kwargs, device, plan, keep)
                return _backward(bwd, out, leaves, device)
        except ReplayError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ReplayError(f"backward replay failed with {type(exc).__name__}: {str(exc)[:300]}") from None


def _grad_inputs(job: Job, device: torch.device, bench: bool) -> tuple[str | None, bool, Any, dict, dict]:
    """The start of a replay with autograd (`run_backward`, `run_forward_kept`): the random plan and the checks,
    then the inputs with the training's leaves. Returns (plan, bench: the precision after the plan, args, kwargs,
    leaves)."""
    plan, bench = _checked_plan(job, device, bench)
    args, kwargs, leaves = prepare_inputs(job, device, bench, requires_grad=True)
    return plan, bench, _differentiable_copies(job, args, leaves), kwargs, leaves


def _differentiable_copies(fwd: Job, args, leaves: dict):
    """An in-place op cannot act on a leaf that requires grad: it gets a differentiable copy."""
    if not fwd.inplace:
        return args
    index = {id(t): t for t in leaves.values()}
    return map_leaves(args, lambda v: v.clone() if isinstance(v, torch.Tensor) and id(v) in index else v)


@dataclasses.dataclass
class KeptForward:
    """A forward replay with its autograd graph, kept for the call's backward replay (`backward_from`): the backward
    then runs on this graph instead of replaying the forward a second time."""

    out: Any
    leaves: dict[int, torch.Tensor]
    bench: bool      # the run's precision after the random plan (a reproduced stream runs in the recorded dtype)
    nbytes: int      # what the graph holds (`held_bytes`): its leaves, outputs and saved tensors, each memory once


def run_forward_kept(job: Job, device: torch.device, bench: bool,
                     match_threads: bool = True) -> tuple[Any, KeptForward | None]:
    """`run_forward` of a call whose backward record will come: the same replay with the inputs that required grad
    in training as leaves and autograd on, as `run_backward` replays the forward, so that the backward replay can
    reuse its graph. Returns the output and the kept graph (None where nothing is differentiable). A replay that
    fails this way is run again as `run_forward` (which then decides the row), without a graph."""
    try:
        return _forward_kept(job, device, bench, match_threads)
    except ReplayError:
        return run_forward(job, device, bench, match_threads), None


def _forward_kept(job: Job, device: torch.device, bench: bool, match_threads: bool) -> tuple[Any, KeptForward | None]:
    with global_state_guard(device, f"{job.category}.{job.api}"):
        plan, bench, args, kwargs, leaves = _grad_inputs(job, device, bench)
        ac = None if bench else _autocast_dtype(job)
        try:
            keep = sdpa_keep_mask(job, device, match_threads) if plan == "sdpa" and bench else None
            with torch.enable_grad() if leaves else torch.no_grad(), _threads(job, device, bench, match_threads), \
                    _autocast(device, ac):
                out = call_api(job, args, kwargs, device, plan, keep)
        except ReplayError:
            raise
        except Exception as exc:  # noqa: BLE001 - the replay failing is a reported outcome, not a crash
            raise ReplayError(f"replay failed with {type(exc).__name__}: {str(exc)[:300]}") from None
    outs = [t for t in iter_leaves(out) if isinstance(t, torch.Tensor)]
    if not leaves or not any(t.requires_grad for t in outs):
        return out, None
    return out, KeptForward(out, leaves, bench, held_bytes(list(leaves.values()), outs))


def held_bytes(leaves: list[torch.Tensor], outs: list[torch.Tensor]) -> int:
    """The memory a kept forward graph holds, each storage counted once: the replay's leaves (its private copies of
    the inputs), its outputs, and every tensor the graph's nodes saved for the backward (a node's `_saved_*`, a
    Python function's `saved_tensors`; most are a leaf or an output again, or views of one). Read from the graph
    itself rather than guessed from the call: a linear saves its input and weight (the leaves) and nothing more,
    an attention its projections, weights and masks (several times its inputs). An output whose memory
    `release_outputs` let go counts nothing."""
    return _with_outputs(_backward_reads(leaves, outs), outs)


def release_outputs(kept: KeptForward) -> None:
    """Let go of the memory of each output of a kept forward graph that its backward does not read, once the
    outputs were copied out (the replay worker's answer, gpu_server/replay/sandbox_worker.py): the backward replay
    (`backward_from`) needs the outputs' shapes, dtypes and nodes, not their values, unless a node saved them (an
    exp, a softmax) or they are views of a leaf (a transpose). A linear's or an attention's output is then kept as a
    tensor of no memory, and the graph's size (`nbytes`) is counted again without it."""
    outs = [t for t in iter_leaves(kept.out) if isinstance(t, torch.Tensor)]
    needed = _backward_reads(list(kept.leaves.values()), outs)
    for t in outs:
        if _storage_key(t) in needed:
            continue
        try:
            t.untyped_storage().resize_(0)
        except (RuntimeError, NotImplementedError):   # a storage that cannot be resized (or none): kept as it is
            pass
    kept.nbytes = _with_outputs(needed, outs)   # the graph's walk once: what it saved did not change


def _with_outputs(needed: dict[tuple[str, int], int], outs: list[torch.Tensor]) -> int:
    """The bytes of `needed` (`_backward_reads`) and of the outputs' storages, each storage once."""
    sizes = dict(needed)
    for t in outs:
        _add_storage(sizes, t)
    return sum(sizes.values())


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # a layout without one storage (sparse)
        return "", id(t)


def _add_storage(sizes: dict[tuple[str, int], int], t: Any) -> None:
    if isinstance(t, torch.Tensor):
        key = _storage_key(t)
        try:
            sizes[key] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):   # its own bytes
            sizes[key] = t.element_size() * t.numel()
    elif isinstance(t, (tuple, list)):
        for x in t:
            _add_storage(sizes, x)


def _backward_reads(leaves: list[torch.Tensor], outs: list[torch.Tensor]) -> dict[tuple[str, int], int]:
    """The storages (by device and address, with their sizes) a backward from `outs` reads: the leaves' and those of
    every tensor a node of the graph saved (walked from the outputs' nodes down to the leaves)."""
    sizes: dict[tuple[str, int], int] = {}
    for t in leaves:
        _add_storage(sizes, t)
    stack = [t.grad_fn for t in outs if t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_") or name == "saved_tensors":
                try:
                    _add_storage(sizes, getattr(node, name))
                except RuntimeError:   # released, or not a tensor this node can give back
                    pass
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None and not hasattr(nxt, "variable"))
    return sizes


def backward_from(kept: KeptForward, fwd: Job, bwd: Job, device: torch.device, match_threads: bool = True) -> list:
    """`run_backward` on a forward kept by `run_forward_kept`: the same gradients, without replaying the forward.
    The graph is used once."""
    with global_state_guard(device, f"{fwd.category}.{fwd.api}"):
        try:
            with _threads(fwd, device, kept.bench, match_threads):
                return _backward(bwd, kept.out, kept.leaves, device)
        except ReplayError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ReplayError(f"backward replay failed with {type(exc).__name__}: {str(exc)[:300]}") from None


def _backward(bwd: Job, out, leaves: dict, device: torch.device) -> list:
    outs = [t for t in iter_leaves(out) if isinstance(t, torch.Tensor)]
    grads = list(bwd.grad_output) if isinstance(bwd.grad_output, (list, tuple)) else [bwd.grad_output]
    if len(grads) != len(outs):
        raise ReplayError(f"backward record has {len(grads)} grad_outputs for {len(outs)} outputs")
    pairs = [(o, to_device(g, device, o.dtype)) for o, g in zip(outs, grads)
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


# -- scaled_dot_product_attention with dropout ----------------------------------------------------------------------
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def _sdpa_args(args: tuple, kwargs: dict) -> tuple:
    if len(args) > len(_SDPA_PARAMS) or set(kwargs) - set(_SDPA_PARAMS):
        raise ReplayError("scaled_dot_product_attention called with arguments it does not document")
    return tuple(kwargs.get(n, args[i] if i < len(args) else d) for i, (n, d) in enumerate(zip(_SDPA_PARAMS,
                                                                                                  _SDPA_DEFAULTS)))


def sdpa_keep_mask(job: Job, device: torch.device, match_threads: bool = True) -> torch.Tensor:
    """The keep-mask (True = kept) the device's kernel drew, shaped (..., L, S), recovered from same-dtype replays.

    Each replay starts from the recorded generator state and calls the kernel with the call's own shapes and dtypes,
    with `value` replaced by one-hot columns: the output is then the dropped-out attention matrix, block by block,
    zero exactly where an entry was dropped. (Entries whose attention weight is itself zero in the device's dtype
    count as kept: they contribute nothing either way.)"""
    args, kwargs, _ = prepare_inputs(job, device, bench=False)
    q, k, v, attn_mask, p, is_causal, scale, gqa = _sdpa_args(args, kwargs)
    s_len, ev = k.shape[-2], v.shape[-1]
    probes = math.ceil(s_len / max(ev, 1))
    if probes > _SDPA_MAX_PROBES:
        raise ReplayError(f"scaled_dot_product_attention with dropout: recovering its keep-mask would take {probes} "
                          f"kernel calls (key length {s_len}, value width {ev}); {_RANDOM_ADVICE}")
    fn = resolve(job.category, job.api)
    blocks = []
    with torch.no_grad(), _threads(job, device, False, match_threads), _autocast(device, _autocast_dtype(job)):
        for b in range(probes):
            width = min(ev, s_len - b * ev)
            probe = torch.zeros_like(v)
            idx = torch.arange(width, device=device)
            probe[..., b * ev + idx, idx] = 1
            with _rng(job, device):
                out = fn(q, k, probe, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal, scale=scale,
                         enable_gqa=gqa)
            blocks.append(out[..., :width] != 0)
    dropped_or_zero = ~torch.cat(blocks, dim=-1)
    # where the weight is zero anyway, call it kept: the same-dtype weights without dropout tell which those are
    with torch.no_grad(), _autocast(device, _autocast_dtype(job)):
        weights = _sdpa_weights(q, k, attn_mask, is_causal, scale, gqa)
    return ~(dropped_or_zero & (weights.to(torch.float32) != 0))


def _sdpa_weights(q, k, attn_mask, is_causal, scale, gqa) -> torch.Tensor:
    l_len, s_len = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if gqa and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        scores = scores.masked_fill(~torch.ones(l_len, s_len, dtype=torch.bool, device=q.device).tril(), -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask
    return torch.softmax(scores, dim=-1)


def sdpa_reference(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                   keep: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ·scale + mask) with the given keep-mask and 1/(1-p) scaling, times v: the math torch documents
    for scaled_dot_product_attention, differentiable, in the inputs' (bench) precision."""
    weights = _sdpa_weights(q, k, attn_mask, is_causal, scale, enable_gqa)
    weights = weights * keep.to(device=weights.device, dtype=weights.dtype) / (1.0 - dropout_p)
    if enable_gqa and v.dim() >= 3 and q.shape[-3] != v.shape[-3]:
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    return weights @ v


# -- global torch state ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _state_items(device: torch.device) -> list[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """(name, read, restore) for every piece of process-wide torch state a replay must leave as it found it."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    items = [
        ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("default device", lambda: str(torch.empty(0).device),   # what a factory creates (52 us -> 2 us)
         lambda v: torch.set_default_device(None if v == "cpu" else v)),
        ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        ("anomaly detection", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
        ("intra-op thread count", torch.get_num_threads, torch.set_num_threads),
        ("deterministic algorithms",
         lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
         lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        ("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        ("oneDNN", lambda: torch.backends.mkldnn.enabled, lambda v: setattr(torch.backends.mkldnn, "enabled", v)),
        ("default generator of the CPU", torch.get_rng_state, torch.set_rng_state),
    ]
    if device.type == "cuda":   # flags only a CUDA bench reads (reading them costs microseconds each)
        items += [
            ("cuDNN flags", lambda: (cudnn.enabled, cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32),
             lambda v: _set_attrs(cudnn, ("enabled", "deterministic", "benchmark", "allow_tf32"), v)),
            ("CUDA matmul flags", lambda: (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
                                           matmul.allow_bf16_reduced_precision_reduction),
             lambda v: _set_attrs(matmul, ("allow_tf32", "allow_fp16_reduced_precision_reduction",
                                           "allow_bf16_reduced_precision_reduction"), v)),
        ]
    if device.type != "cpu":
        getter, setter = _rng_access(device)
        items.append((f"default generator of {device}", getter, setter))
    return items


def _set_attrs(obj, names, values) -> None:
    for name, value in zip(names, values):
        setattr(obj, name, value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


@contextlib.contextmanager
def global_state_guard(device: torch.device, what: str):
    """Check torch's global state before and after the body. A body that changed it raises ReplayError (a SKIP row
    naming what changed) after the state has been put back, whatever else the body raised."""
    items = _state_items(device)
    with STATE_LOCK:
        before = [read() for _, read, _ in items]
    failure: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - re-raised below unless the state check has the better reason
        failure = exc
    changed = []
    with STATE_LOCK:
        for (name, read, restore), old in zip(items, before):
            try:
                now = read()
                if not _same(now, old):
                    changed.append(name)
                    restore(old)
            except Exception as exc:  # noqa: BLE001 - a state we cannot read back or restore is reported too
                changed.append(f"{name} ({type(exc).__name__})")
    if changed:
        raise ReplayError(f"not replayable: replaying {what} changed the server's global torch state ("
                          f"{', '.join(changed)}); the state was restored") from None
    if failure is not None:
        raise failure


# -- loading torch's meta kernels ahead of the first dry run --------------------------------------------------------
_warmed = False


def warm_up() -> None:
    """Run one meta-device operation. The first of a process imports torch's Python meta registrations (sympy and
    friends: about 1.5 s on an idle core, far more under load); the server calls this while starting, before it
    opens its transport, so no record waits for it and nothing runs behind the start-up's back."""
    global _warmed
    if _warmed:
        return
    try:
        torch.mm(torch.empty(2, 2, device="meta"), torch.empty(2, 2, device="meta")).add_(1)
    except Exception:  # noqa: BLE001 - the dry run then loads them itself (or finds no meta kernel)
        pass
    _warmed = True
