"""Level-L1 capture: a TorchFunctionMode that names each API call and snapshots it (docs/design.md §4).

Snapshots hold references (npu_agent.snapshot): a call that writes its arguments (in place by name or keyword, or
known to: batch_norm's running statistics, an operator's `Tensor(a!)` arguments, a torch.distributed collective's
or receive's buffers; `written_tensors`) first has every record still holding them copy them, and its own
inputs are copied before it runs. Calls that are not APIs get the same copy before they write (`protect_unseen`).
A call found to have written its inputs anyway is learned: its record goes out skipped and its later calls copy.
The sampling policies (npu_agent.sampling) decide which calls are recorded.
A call the server's allowlist (protos/apis.py) refuses by name is recorded without tensors, skipped with the
reason: the report lists it as SKIP, and neither side spends time or memory on it.

The mode is pushed only while capture is on. Inside `__torch_function__` the mode is already popped, so what
the API does internally, and our own copies, are not seen. Nothing here may raise into the training: every
failure of ours is counted and logged once, and the call itself always runs exactly as it would without us.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from npu_agent import collectives, location, naming
from npu_agent.records import PendingRecord
from npu_agent.snapshot import HELD, iter_tensors, map_tensors, snapshot, snapshot_call, use_compiled
from npu_agent.snapshot import install as snapshot_install
from protos import apis
from protos.codec import dtype_name
from protos.rng import generator_state, set_generator_state
from protos.torch_compat import (
    find_operator,
    function_mode_stack,
    in_backward_pass,
    op_overload_name,
    tensor_version,
    written_arguments,
)

if TYPE_CHECKING:
    from npu_agent.backward import BackwardTaps
    from npu_agent.checkpoint import Region
    from npu_agent.sampling import Sampler

log = logging.getLogger("npu_agent")


@dataclasses.dataclass(slots=True)
class CallContext:
    record: PendingRecord
    category: str
    api: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    taps: Any = None   # backward taps installed for this call (npu_agent.backward)
    recompute: bool = False  # a checkpoint recompute of a call recorded in the first pass: taps only
    dropout: Any = None      # dropout family: (generator state before the call, p), to rebuild the keep-mask
    copied: bool = False     # the inputs were copied before the call (it writes them)
    plan: Any = None         # a collective: what it is recorded as (npu_agent.collectives.Plan)


# -- what a call writes that is not in place by name (issue 22) ------------------------------------------------------
# A spec: (positions, keyword names) of the written arguments; _ALL: every tensor argument; _P2P: the receives of a
# batch_isend_irecv list; None: nothing. Cached per function object (the mode sees the same objects again).
_Spec = tuple[tuple[int, ...], tuple[str, ...]] | str | None
_ALL, _P2P = "all", "p2p"
_FIRST = {"tensor": ((0,), ("tensor",)), "output": ((0,), ("output",)), "output_tensor": ((0,), ("output_tensor",))}
# torch.distributed reaches the mode through __torch_function__ (torch>=2.13, has_torch_function in
# distributed_c10d). Its writes bump no `_version`, so only a copy before the call keeps a held tensor's value.
_DIST_WRITES: dict[str, _Spec] = {
    "broadcast": _FIRST["tensor"], "all_reduce": _FIRST["tensor"], "reduce": _FIRST["tensor"],
    "scatter": _FIRST["tensor"], "recv": _FIRST["tensor"], "irecv": _FIRST["tensor"],
    "all_reduce_coalesced": ((0,), ("tensors",)), "all_gather": ((0,), ("tensor_list",)),
    "all_gather_single": _FIRST["output_tensor"], "all_gather_into_tensor": _FIRST["output_tensor"],
    "_all_gather_base": _FIRST["output_tensor"], "all_gather_coalesced": ((0,), ("output_tensor_lists",)),
    "gather": ((1,), ("gather_list",)), "reduce_scatter": _FIRST["output"], "reduce_scatter_single": _FIRST["output"],
    "reduce_scatter_tensor": _FIRST["output"], "_reduce_scatter_base": _FIRST["output"],
    "all_to_all_single": _FIRST["output"], "all_to_all": ((0,), ("output_tensor_list",)),
    "batch_isend_irecv": _P2P,
    # read only (objects are pickled, never written into a tensor in place)
    "send": None, "isend": None, "barrier": None, "monitored_barrier": None, "all_gather_object": None,
    "gather_object": None, "broadcast_object_list": None, "scatter_object_list": None, "send_object_list": None,
    "recv_object_list": None,
}   # any other function of torch.distributed.distributed_c10d: _ALL
_NOT_DATA_WRITES = frozenset({"requires_grad_", "detach_", "share_memory_", "retain_grad"})
_SPECS: dict[Any, _Spec] = {}
_MAX_CACHED = 8192
_WRITES_NOTHING: set[Any] = set()   # calls that are not APIs and write none of their arguments


def _spec(func: Any, category: str, api: str) -> _Spec:
    if category == "Distributed":
        module = getattr(func, "__module__", "") or ""
        if module == "torch.distributed.distributed_c10d":
            return _DIST_WRITES.get(api, _ALL)
        if op_overload_name(func) is not None:   # torch.ops._c10d_functional.*: the schema tells
            return written_arguments(func)
        if module.endswith("_functional_collectives") and "inplace" not in api and not api.endswith("_"):
            return None   # out of place: returns new tensors
        return _ALL       # unknown: every tensor it is given may be written
    op = func
    if category == "NPU" and op_overload_name(func) is None:   # torch_npu.npu_x: the operator torch.ops.npu.x
        op = find_operator("npu", api)
    written = written_arguments(op)
    if written is not None:
        return written
    if category == "" and naming.inplace_by_name(api) and api not in _NOT_DATA_WRITES:   # torch._amp_*_ and kin
        return _ALL
    return None


def _picked(spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    if spec == _ALL:
        return list(iter_tensors((args, kwargs)))
    if spec == _P2P:   # batch_isend_irecv(p2p_op_list): the tensors of the receives
        ops = args[0] if args else kwargs.get("p2p_op_list", ())
        return [op.tensor for op in ops if isinstance(getattr(op, "tensor", None), torch.Tensor)
                and getattr(op.op, "__name__", "") not in ("send", "isend")]
    assert not isinstance(spec, str) and spec is not None   # the remaining case: a (positions, names) pair
    positions, names = spec
    chosen = [args[i] for i in positions if i < len(args)]
    if kwargs:
        chosen += [kwargs[n] for n in names if n in kwargs]
    return list(iter_tensors(chosen))


def written_tensors(func: Any, category: str, api: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a call writes that neither its name nor `out=` nor `inplace=True` tells: `Tensor(a!)` arguments
    of a `torch.ops` operator (aten, torch_npu, custom), a torch.distributed collective's or receive's buffers.
    category "" is a call that is not an API."""
    spec = _cached_spec(func, category, api)
    return _picked(spec, args, kwargs) if spec is not None else []


def _cached_spec(func: Any, category: str, api: str) -> _Spec:
    try:
        return _SPECS[func]
    except KeyError:
        if len(_SPECS) > _MAX_CACHED:
            _SPECS.clear()
        spec = _SPECS[func] = _spec(func, category, api)
        return spec
    except TypeError:   # unhashable callable
        return _spec(func, category, api)


def protect_unseen(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A call that is not an API (torch's private in-place functions, an op namespace the agent skips, torch's own
    operator namespaces; a custom operator is an API, category Custom, its `Tensor(a!)` arguments `written_tensors`):
    before it writes a tensor a pending record holds, that record gets its copy."""
    name = getattr(func, "__name__", None)
    if not isinstance(name, str) or name in ("__get__", "__set__", "__delete__"):   # property accessors
        spec: _Spec = None
    else:
        spec = _cached_spec(func, "", name)
    if spec is None:
        if len(_WRITES_NOTHING) > _MAX_CACHED:   # functions made at run time: keep the set bounded
            _WRITES_NOTHING.clear()
        with contextlib.suppress(TypeError):    # unhashable: looked up again next time
            _WRITES_NOTHING.add(func)           # the mode's next call of it costs one set lookup
    written = _picked(spec, args, kwargs) if spec is not None else []
    if kwargs and kwargs.get("out") is not None:
        written += iter_tensors(kwargs["out"])
    if written:
        HELD.protect(written)


# categories whose writes are looked up (written_tensors): a custom operator's `Tensor(a!)` arguments too
_BY_TABLE = frozenset({"Aten", "NPU", "Distributed", "Custom"})

# What a call's (category, api) tells before its arguments are looked at, per API: (in place by name, its writes
# looked up by table, a collective checked across ranks, random by name). The mode asks for every call.
_KINDS: dict[tuple[str, str], tuple[bool, bool, bool, bool]] = {}
_CLASSIFIED = naming.CLASSIFIED
_is_compiling = torch.compiler.is_compiling
_METHOD_WRAPPER = type(None.__repr__)   # a slot bound to its object: a property's `__get__`
_grad_enabled = torch.is_grad_enabled


def _kind(category: str, api: str) -> tuple[bool, bool, bool, bool]:
    return (naming.inplace_by_name(api), category in _BY_TABLE,
            category == "Distributed" and (api in collectives.CAPTURED or api == collectives.WAIT),
            naming.is_random(api))


_ON: list["CaptureMode"] = []   # capture modes pushed now, on any thread (for the custom backwards below)
_backward_installed = False


def _install_backward_mode() -> None:
    """The autograd engine runs a custom Function's backward without the torch function modes of the thread that
    called backward(): a collective there (tensor-parallel layers all-reduce their gradients) would not be seen.
    While a capture mode is on, the mode is pushed again around each custom backward; what it sees there is a
    backward-pass call (a collective is recorded; other calls only protect what records hold)."""
    global _backward_installed
    if _backward_installed:
        return
    _backward_installed = True
    try:
        from torch.autograd.function import BackwardCFunction

        from protos.torch_compat import reentrant_checkpoint_function

        original: Callable[..., Any] = BackwardCFunction.apply
        checkpoint_fn = reentrant_checkpoint_function()   # its recompute pushes the mode itself (npu_agent.checkpoint)

        def apply(self: Any, *args: Any) -> Any:
            if not _ON or getattr(self, "_forward_cls", None) is checkpoint_fn:
                return original(self, *args)
            mode = _ON[-1]
            if mode in function_mode_stack():
                return original(self, *args)
            with mode:
                return original(self, *args)

        setattr(BackwardCFunction, "apply", apply)   # noqa: B010 - once, on the class the engine calls
    except Exception:  # noqa: BLE001 - collectives in custom backwards are then not seen
        log.debug("online check: custom backwards could not be wrapped", exc_info=True)


class CaptureMode(TorchFunctionMode):
    def __init__(self, capturer: "Capturer"):
        super().__init__()
        self.capturer = capturer
        _install_backward_mode()

    def __enter__(self) -> "CaptureMode":
        super().__enter__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        _ON.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(ValueError):
            _ON.remove(self)
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if _is_compiling():  # must stay the first statement: compiled regions are opaque
            return func(*args, **(kwargs or {}))
        cap = self.capturer
        skip = cap.skip   # the compiled answer for a call the sampling skips (npu_agent.fastskip), or None
        if skip is not None and skip(func, args, kwargs):
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if type(func) is _METHOD_WRAPPER and not kwargs and func.__name__ == "__get__":
            # a property's getter (x.shape), made anew at each access: no API (naming.classify), and it writes
            # nothing (protect_unseen); before, two failed cache lookups cost it about 4 us
            return func(*args)
        try:
            info = _CLASSIFIED[func]   # naming.classify's cache, looked up without the call
        except Exception:  # noqa: BLE001 - not cached yet, or unhashable: the full path
            try:
                info = naming.classify(func)
            except Exception as exc:  # noqa: BLE001 - an unknown kind of callable: run it, uncaptured
                cap.internal_error(f"naming {getattr(func, '__name__', type(func).__name__)}", exc)
                info = None
        if info is None:
            if HELD.pending:   # not an API, yet it may write a tensor a record holds (a custom op, `out=`)
                try:
                    if kwargs or func not in _WRITES_NOTHING:   # metadata calls: one set lookup
                        protect_unseen(func, args, kwargs)
                except Exception as exc:  # noqa: BLE001
                    cap.internal_error(f"protecting the arguments of {getattr(func, '__name__', '?')}", exc)
            return func(*args, **kwargs)
        try:
            ctx = cap.before_call(func, info, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - our failure must never reach the training
            cap.internal_error("capturing the inputs of " + ".".join(info), exc)
            ctx = None
        if ctx is None:
            return func(*args, **kwargs)
        try:
            out = func(*ctx.args, **ctx.kwargs)
        except BaseException as exc:
            if ctx.plan is not None:   # a collective raised (a backend timeout): its record says so
                cap.collective_failed(ctx, exc)
            raise
        try:
            return cap.after_call(ctx, out)
        except Exception as exc:  # noqa: BLE001
            cap.internal_error("capturing the outputs of " + ctx.record.name, exc)
            return out


def _finite_nonzero_py(x: torch.Tensor) -> bool:
    """Every element of `x` finite and not zero (a dropout's keep-mask is then where its output is not zero): one
    device sync; NaN compares false. False where aminmax does not take the dtype (the mask is rebuilt then).
    npu_agent/_fastmask.cpp's `finite_nonzero` gives the same answer in C++."""
    try:
        low, high = torch.stack(torch.aminmax(x.detach().abs())).tolist()
    except (RuntimeError, TypeError):
        return False
    return bool(low > 0 and high < math.inf)


def _state_bytes_py(state: torch.Tensor) -> bytes:
    """A generator state's bytes, as a random call's record carries them. npu_agent/_fastmask.cpp's `state_bytes`
    gives the same bytes in C++."""
    return state.cpu().numpy().tobytes()


# _finite_nonzero_py and _state_bytes_py, or npu_agent/_fastmask.cpp's `finite_nonzero` and `state_bytes` once
# `use_compiled_mask()` found it
_finite_nonzero: Callable[[torch.Tensor], bool] = _finite_nonzero_py
_state_bytes: Callable[[torch.Tensor], bytes] = _state_bytes_py


def use_compiled_mask() -> None:
    """A random call's dropout check and generator state's bytes in C++ from now on where npu_agent/_fastmask.cpp is
    built for this torch (npu_agent.compiled), else in Python (a Capturer calls it when it is made)."""
    global _finite_nonzero, _state_bytes
    from npu_agent.compiled import MASK

    module = MASK.load()
    if module is None:
        _finite_nonzero, _state_bytes = _finite_nonzero_py, _state_bytes_py
    else:
        _finite_nonzero, _state_bytes = module.finite_nonzero, module.state_bytes


def _nonzero(t: torch.Tensor) -> torch.Tensor:
    """`t != 0` as a bool tensor: the cast to bool is that comparison (NaN true, -0.0 false) at a quarter of its
    cost on a CPU (a 4 MiB float32 output: 0.19 against 0.78 ms)."""
    return t.bool()


_DEVICE_TYPES: dict[Any, str] = {}   # torch.device -> its type: `device.type` builds a new string each time


def _device_type(device: Any) -> str:
    try:
        return _DEVICE_TYPES[device]
    except KeyError:
        if len(_DEVICE_TYPES) > 256:
            _DEVICE_TYPES.clear()
        kind: str = device.type
        _DEVICE_TYPES[device] = kind
        return kind


def _first_device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    for v in args:   # the common case: a tensor among the positional arguments
        if isinstance(v, torch.Tensor):
            return _device_type(v.device)
    for t in iter_tensors((args, kwargs)):
        return _device_type(t.device)
    return "cpu"


_AUTOCAST: dict[tuple[str, Any], tuple[bool, str, str]] = {}   # (device type, autocast dtype) -> the state


def autocast_state(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, str, str]:
    device_type = _first_device_type(args, kwargs)
    try:
        if not torch.is_autocast_enabled(device_type):
            return (False, "", device_type)
        dtype = torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return (False, "", device_type)
    try:
        return _AUTOCAST[(device_type, dtype)]
    except KeyError:
        state = _AUTOCAST[(device_type, dtype)] = (True, dtype_name(dtype), device_type)
        return state


def _dropout_params(category: str, api: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[float, bool] | None:
    """(p, training) of a dropout-family call, from its documented signature."""
    if category == "Functional":  # F.dropout*(input, p=0.5, training=True, inplace=False)
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
    elif category in ("Torch", "Tensor"):  # torch.dropout(input, p, train)
        p = args[1] if len(args) > 1 else kwargs.get("p")
        training = args[2] if len(args) > 2 else kwargs.get("train", True)
    else:
        return None
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        return None
    return float(p), bool(training)


class Capturer:
    """Turns calls into PendingRecords and hands them to `sink` (the sender)."""

    def __init__(self, sink: Callable[[PendingRecord], object], api_list: tuple[str, ...] = (),
                 scope: tuple[str, ...] = (), backward: BackwardTaps | None = None, sampler: Sampler | None = None,
                 locate: bool = True, ranks: frozenset[int] = frozenset()):
        # sink: the sender's submit; its result (False: dropped) is ignored here, the sender counts its drops
        self.sink = sink
        self.api_list = api_list
        self.scope = scope
        self.backward = backward          # npu_agent.backward.BackwardTaps, or None
        snapshot_install()                # copy-on-write before optimizer.step() / zero_grad of held tensors
        self.sampler = sampler            # npu_agent.sampling.Sampler, or None: every call
        self.locate = locate              # records carry their module path and source line (npu_agent.location)
        self.counters = naming.Counters()
        self._counts = self.counters.counts   # the same dict, counted in place by before_call
        self.step = 0
        self.captured = 0
        self.errors = 0
        self._scope_state = 0             # 0: before scope[0]; 1: inside; 2: after scope[1]
        self.region: Region | None = None  # the reentrant checkpoint region running now (npu_agent.checkpoint)
        self.open_regions: list[Any] = []      # regions whose records wait for their recompute
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._writes_inputs: set[tuple[str, str]] = set(naming.WRITES_INPUTS)  # not in-place by name, yet write
        self._by_name: dict[tuple[str, str], str | None] = {}   # (category, api) -> why not replayable, or None
        # torch.distributed collectives (npu_agent.collectives); `ranks`: the config's ranks that capture (empty: all)
        self.collectives = collectives.Collectives(self._submit_direct, ranks)
        collectives.install()
        # a call the sampling skips, answered in C where built: the same bookkeeping as before_call's
        from npu_agent import fastskip  # here: `python -m npu_agent.compiled` imports the package first

        self.skip = fastskip.skipper(self)
        use_compiled()   # a recorded call's arguments held (snapshot_call), in C where built
        use_compiled_mask()   # a random call's dropout check and generator state, in C++ where built

    # -- step boundary -------------------------------------------------------------------------------------
    def next_step(self, step: int) -> None:
        self.release_regions()
        self.flush_collectives()
        self.counters.reset()
        self.step = step
        self._scope_state = 0
        if self.sampler is not None:
            self.sampler.take_step(step)

    def flush_collectives(self) -> None:
        """Async collectives never waited on: their records go out unfinished (step boundary, capture stop)."""
        try:
            if collectives.PENDING:
                collectives.PENDING.flush(self.collectives)
        except Exception as exc:  # noqa: BLE001
            self.internal_error("sending unfinished collectives", exc)

    def release_regions(self) -> None:
        """Regions never recomputed (no backward ran): their held forward records go out as they are."""
        regions, self.open_regions = self.open_regions, []
        for region in regions:
            region.release(self)

    # -- selection -----------------------------------------------------------------------------------------
    def _selected(self, full_name: str) -> bool:
        if self.scope:
            first, last = self.scope
            if self._scope_state == 0 and full_name == first:
                self._scope_state = 1
            if self._scope_state != 1:
                return False
            if full_name == last:
                self._scope_state = 2
        return naming.matches_list(full_name, self.api_list)

    # -- the two halves of a call --------------------------------------------------------------------------
    def before_call(self, func: Any, info: tuple[str, str], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> CallContext | None:
        category, api = info
        try:
            by_name, by_table, collective, random = _KINDS[info]
        except KeyError:
            by_name, by_table, collective, random = _KINDS[info] = _kind(category, api)
        inplace = naming.is_inplace(api, kwargs) if kwargs else by_name
        # Whether the call writes its arguments: looked up now when records hold tensors (they get their copies
        # first), else only for a call that is recorded (its inputs are then copied); a skipped call costs nothing.
        # A call neither in place, nor looked up by table, nor known to write its inputs writes nothing.
        if inplace or by_table or info in self._writes_inputs:
            writes = self._writes(func, info, inplace, by_table, args, kwargs) if HELD.pending else None
        else:
            writes = False
        if collective:
            # every collective, in forward, in a custom backward or a checkpoint recompute: checked across ranks
            return self._collective_call(func, api, args, kwargs)
        if in_backward_pass():
            # Inside a backward pass: a checkpoint recompute or a custom backward. Its forward was recorded already.
            return self._recompute_call(info, args, kwargs)
        # The call's index is counted now; its name is spelled only for a call that is selected and sampled (a call
        # the sampling skips costs no string).
        counts = self._counts
        index = counts.get(info, 0)
        counts[info] = index + 1
        if self.scope or self.api_list:
            if not self._selected(f"{category}.{api}.{index}"):
                return None
        grad_enabled = _grad_enabled()
        sampler = self.sampler
        if sampler is not None and not sampler.take_call(category, api, args, kwargs, grad_enabled):
            return None
        rec = PendingRecord(name=f"{category}.{api}.{index}", step=self.step, grad_enabled=grad_enabled,
                            inplace=inplace, autocast=autocast_state(args, kwargs))
        if self.locate:   # from the frame below CaptureMode.__torch_function__ (ours: this one, then that one)
            rec.module, rec.source = location.current(3)
        if category == "Distributed":
            rec.skip_reason = collectives.not_checked_reason(api)
            return CallContext(rec, category, api, args, kwargs)
        try:
            why = self._by_name[info]
        except KeyError:
            why = self._not_replayable(info)
        if why is not None:
            # The server would refuse it by name (protos/apis.py): sent without tensors, reported SKIP with `why`.
            rec.skip_reason = why
            return CallContext(rec, category, api, args, kwargs)
        if writes is None:
            writes = self._writes(func, info, inplace, by_table, args, kwargs)
        # inputs the call writes: their value before it
        rec.inputs = snapshot((args, kwargs), copy=True) if writes else snapshot_call(args, kwargs)
        ctx = CallContext(rec, category, api, args, kwargs, copied=writes)
        if random:
            ctx.dropout = self._random_state(rec, category, api, args, kwargs)
        if grad_enabled and self.backward is not None:
            self.backward.tap_inputs(ctx)
        return ctx

    def _writes(self, func: Any, info: tuple[str, str], inplace: bool, by_table: bool, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> bool:
        """Does this call write (some of) its tensor arguments? Records still holding them get their copy first."""
        if inplace or info in self._writes_inputs:
            if HELD.pending:
                HELD.protect_tree((args, kwargs))
            return True
        if by_table:
            written = written_tensors(func, info[0], info[1], args, kwargs)
            if written:   # an operator's `Tensor(a!)` arguments, a collective's buffers
                if HELD.pending:
                    HELD.protect(written)
                return True
        return False

    def _collective_call(self, func: Any, api: str, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> CallContext | None:
        """A collective (npu_agent.collectives): its seq is counted before any selection, so that every rank of
        the group gives the same collective the same seq; the sampling decision depends only on (step, api, group,
        op), equal on every rank of the group."""
        coll = self.collectives
        if api == collectives.WAIT:   # torch.ops._c10d_functional.wait_tensor(t): t's record takes its output
            if collectives.PENDING and args:
                return CallContext(PendingRecord(name="", step=self.step), "Distributed", api, args, kwargs,
                                   plan=args[0])
            return None
        plan = coll.plan(func, api, args, kwargs)
        if plan is None:   # this rank is not in the group: the call does nothing
            return None
        name = self.counters.next_name("Distributed", api)
        if not self._selected(name):
            return None
        if self.sampler is not None and plan.peer_known and not self.sampler.take_collective(plan.site):
            return None
        rec = PendingRecord(name=name, step=self.step, grad_enabled=torch.is_grad_enabled(),
                            autocast=autocast_state(args, kwargs))
        if self.locate:
            rec.module, rec.source = location.current(4)
        rec.collective = plan.call
        if plan.skip:   # sent without tensors, reported SKIP with the reason
            rec.skip_reason = plan.skip
            rec.collective = None
            return CallContext(rec, "Distributed", api, args, kwargs, plan=plan)
        rec.inputs = snapshot(plan.inputs, copy=True)   # the call writes its buffers: their value before it
        ctx = CallContext(rec, "Distributed", api, args, kwargs, plan=plan)
        ctx.copied = True
        return ctx

    def _collective_done(self, ctx: CallContext, out: Any) -> Any:
        rec, plan, coll = ctx.record, ctx.plan, self.collectives
        if ctx.api == collectives.WAIT:
            collectives.waited(plan, out)   # plan: the functional collective's result tensor
            return out
        if rec.skip_reason:
            self._submit_direct(rec)
            return out
        if not plan.peer_known:   # recv(src=None): the call returned the source
            coll.received_from(plan, out)
            if not plan.skip and self.sampler is not None and not self.sampler.take_collective(plan.site):
                HELD.pending.pop(id(rec.inputs), None)
                return out
            rec.collective = plan.call
            if plan.skip:
                rec.skip_reason, rec.collective, rec.inputs = plan.skip, None, None
                self._submit(rec)
                return out
        if plan.functional:   # out of place: the result is written until it is waited on
            collectives.PENDING.park(out, rec, plan, coll)
        elif rec.collective is not None and rec.collective.async_op and out is not None and plan.has_output:
            collectives.PENDING.park(out, rec, plan, coll)   # the Work: the output at work.wait()
        else:
            collectives.finish(rec, plan, coll)
        return out

    def collective_failed(self, ctx: CallContext, exc: BaseException) -> None:
        try:
            if ctx.api == collectives.WAIT:
                collectives.waited(ctx.plan, exc=exc)
            elif ctx.record.collective is not None:
                collectives.failed(ctx.record, self.collectives, exc)
            else:   # a SKIP record, or a receive from any source that never returned one
                ctx.record.inputs = None
                if not ctx.record.skip_reason:
                    ctx.record.skip_reason = f"torch.distributed.{ctx.api} raised: {exc}"
                self._submit_direct(ctx.record)
        except Exception as err:  # noqa: BLE001
            self.internal_error("recording the failure of " + ctx.record.name, err)

    def _not_replayable(self, info: tuple[str, str]) -> str | None:
        """Why the server's allowlist refuses `Category.api` by name (its arguments are the server's to check), or
        None; cached per API. A custom operator is sent whole: the server's extension file may give it a
        reference (the server says SKIP when it has none)."""
        try:
            return self._by_name[info]
        except KeyError:
            why = self._by_name[info] = None if info[0] == "Custom" else apis.replayable(*info)
            return why

    def _recompute_call(self, info: tuple[str, str], args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> CallContext | None:
        region = self.region
        if region is None or not region.recomputing or self.backward is None:
            return None
        name = region.next_name()
        rec = region.held.get(name) if name else None
        if rec is None or name is None or name.rsplit(".", 1)[0] != ".".join(info) or not torch.is_grad_enabled():
            return None
        ctx = CallContext(rec, info[0], info[1], args, kwargs, recompute=True)
        rec.grad_enabled = True
        self.backward.tap_inputs(ctx)
        return ctx

    def after_call(self, ctx: CallContext, out: Any) -> Any:
        rec = ctx.record
        if ctx.plan is not None:
            return self._collective_done(ctx, out)
        if ctx.recompute:
            if ctx.taps is not None and self.backward is not None:   # recompute calls exist only with backward
                return self.backward.tap_outputs(ctx, out)
            return out
        if rec.skip_reason:
            self._submit(rec)
            return out
        if not ctx.copied and self._wrote_inputs(ctx):
            if ctx.taps is not None and self.backward is not None:
                self.backward.hook_inputs(ctx)   # its gradients still make a backward record
                if ctx.taps[1]:   # give back the original where the API returned our alias
                    aliases = ctx.taps[1]
                    out = map_tensors(out, lambda t: aliases.get(id(t), t))
            return out
        if rec.inplace and out is None and ctx.args and isinstance(ctx.args[0], torch.Tensor):
            produced = ctx.args[0]   # `x[i] = v` returns None: what it produced is the new x
        else:
            produced = out
        rec.output = snapshot(produced)
        if ctx.taps is not None and self.backward is not None:   # taps exist only with self.backward
            out = self.backward.tap_outputs(ctx, out)
        if ctx.dropout is not None:
            rec.mask = self._dropout_mask(ctx, produced)
        self._submit(rec)
        return out

    def _wrote_inputs(self, ctx: CallContext) -> bool:
        """A call not known to write its inputs did (batch_norm's running statistics, embedding's max_norm): the
        values held by reference are gone. The record goes out skipped; later calls of the API copy their inputs."""
        inputs = ctx.record.inputs
        if inputs is None:
            return False
        for e in inputs.held.values():
            if tensor_version(e[0]) != e[1]:
                break
        else:
            return False
        info = (ctx.category, ctx.api)
        self._writes_inputs.add(info)
        rec = ctx.record
        HELD.pending.pop(id(rec.inputs), None)
        rec.inputs = None
        rec.skip_reason = (f"{'.'.join(info)} changed its own inputs in place; its later calls are recorded with "
                           "copies of their inputs")
        self._submit(rec)
        return True

    def _submit_direct(self, rec: PendingRecord) -> None:
        """A collective's record: straight to the sink, never held by a checkpoint region (its recompute calls the
        collective again, a call of its own)."""
        self.captured += 1
        self.sink(rec)

    def _submit(self, rec: PendingRecord) -> None:
        self.captured += 1
        if self.region is not None and not self.region.recomputing:
            self.region.hold(rec)   # released after the region's recompute (or at the step boundary)
        else:
            self.sink(rec)

    # -- random APIs ---------------------------------------------------------------------------------------
    def _random_state(self, rec: PendingRecord, category: str, api: str, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[torch.Tensor, float] | None:
        """Record the generator state before a random call; for the dropout family return (state, p), from which
        the keep-mask is rebuilt after the call."""
        device_type = rec.autocast[2]
        state = generator_state(device_type)
        if state is None:
            return None
        rec.rng_device = device_type
        rec.rng_state = _state_bytes(state)
        params = _dropout_params(category, api, args, kwargs) if api in naming.DROPOUT_MASKED else None
        if params is not None and params[1] and params[0] > 0 and args and isinstance(args[0], torch.Tensor):
            return state, params[0]
        return None

    def _dropout_mask(self, ctx: CallContext, out: Any) -> torch.Tensor:
        """The true keep-mask of a dropout call. Where every input value is finite and not zero, it is where the
        output is not zero: a kept value is scaled by 1/(1-p) >= 1 (never to zero), a dropped one is zero, whatever
        the kernel (`_finite_nonzero`: one aminmax of |x|, a fifth of rebuilding it). Otherwise it is rebuilt from the
        generator state before the call, then the state is put back: the training's random stream is left exactly
        where the real call left it."""
        (state_before, p), category, api = ctx.dropout, ctx.category, ctx.api
        x = ctx.record.inputs.tree[0][0]  # type: ignore[union-attr]  # a dropout call has inputs
        if (isinstance(out, torch.Tensor) and out.shape == x.shape and x.is_floating_point() and x.numel()
                and p < 1 and _finite_nonzero(x)):
            return _nonzero(out.detach())
        device_type = ctx.record.rng_device
        state_after = generator_state(device_type)
        try:
            set_generator_state(device_type, state_before)
            ones = torch.ones_like(x)
            if category == "Functional":
                probe: torch.Tensor = getattr(torch.nn.functional, api.rstrip("_"))(ones, p, True, False)
            else:
                probe = torch.dropout(ones, p, True) if "feature" not in api else torch.feature_dropout(ones, p, True)
            return _nonzero(probe)
        finally:
            set_generator_state(device_type, state_after)  # type: ignore[arg-type]  # not None: state_before was not

    # -- our own failures ----------------------------------------------------------------------------------
    def internal_error(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            key = f"{what.split('.')[0]}:{type(exc).__name__}"
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning("online check: error while %s (%s: %s); the call ran normally and was not recorded; further "
                    "errors of this kind are counted silently", what, type(exc).__name__, exc)
