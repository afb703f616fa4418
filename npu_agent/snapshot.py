"""What a record holds of a call's tensors: references, copied only when something is about to change them.

A snapshot is the call's tree (tuple/list/dict/slice, any nesting; containers rebuilt, so later changes to a list
the training reuses do not show) holding **references** to the training's tensors, each with its `_version` at
capture. Nothing is copied on the training thread unless a tensor would change before the sender has serialised
it (copy on write):

- an in-place call seen by the capture mode (`add_`, `out=`, `__setitem__`, `inplace=True`, the optimizer's
  `_foreach_*_` kernels, ...) first calls `HELD.protect(...)` with the tensors it may write: every pending
  snapshot that references the same storage gets a private copy of the value before the write;
- `optimizer.step()` and `zero_grad(set_to_none=False)` run outside the mode in most loops: `install()` adds a
  global optimizer step pre-hook and wraps `zero_grad` to protect params, their gradients and the optimizer state;
- when capture stops, the parameters and gradients still referenced get their copies (`protect_all`): the code
  between `stop()` and the next `start()` is not seen by the mode, and a manual update writes exactly those.

The sender thread serialises a snapshot by copying each tensor once, straight from its memory into the record's
payload (npu_agent.records), then checks under the lock: a tensor copied on write meanwhile is taken from its copy
(the copy was made before the write began); a tensor whose `_version` moved without a copy (changed by code the
mode did not see) is not sent: the record is marked skipped with the reason, never sent with the changed value.
After serialisation the references are dropped, so the training's memory is freed as soon as it would be without
the checker.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from protos.torch_compat import disable_torch_function, tensor_version
from protos.trees import iter_leaves, map_leaves

_Tensor = torch.Tensor


class Snapshot:
    """A call's tree with references (or private copies) of its tensors. `held[id(t)]` is
    [tensor, version at capture, private copy or None, storage key or None] for every tensor still referenced."""

    __slots__ = ("tree", "nbytes", "requires_grad", "held", "__weakref__")

    def __init__(self, tree: Any, nbytes: int, requires_grad: set[int], held: dict[int, list[Any]] | None = None):
        self.tree = tree
        self.nbytes = nbytes
        self.requires_grad = requires_grad   # ids of the tensors that required grad when captured
        self.held: dict[int, list[Any]] = held if held is not None else {}


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply `fn` to every tensor in a tuple/list/dict/slice tree; other leaves are kept."""
    return map_leaves(obj, lambda v: fn(v) if isinstance(v, _Tensor) else v)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a tree, in the order the server flattens a call's inputs (protos.trees)."""
    return (v for v in iter_leaves(obj) if isinstance(v, _Tensor))


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int] | None:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, some subclasses): nothing aliases it
        return None


class HeldRefs:
    """The snapshots whose references the sender has not serialised yet (one registry per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: dict[int, weakref.ref[Snapshot]] = {}
        self.copied = 0          # tensors copied on write (count) ...
        self.copied_bytes = 0    # ... and their bytes
        self._adds = 0
        self.changed = 0         # tensors found changed by code the mode did not see (their records are skipped)

    def add(self, snap: Snapshot) -> None:
        if snap.held:   # weakly: a record dropped unsent (policy 'drop', a discarding sink) leaves by itself
            self.pending[id(snap)] = weakref.ref(snap)   # a single dict store: atomic under the GIL
            self._adds += 1
            if self._adds & 1023 == 0:
                self._sweep()

    def _sweep(self) -> None:
        with self.lock:
            for _ in self._live():
                pass

    def _live(self) -> Iterator[Snapshot]:
        """The pending snapshots still alive; those gone are forgotten on the way (the caller holds the lock)."""
        for sid, ref in list(self.pending.items()):
            snap = ref()
            if snap is not None:
                yield snap
            elif self.pending.get(sid) is ref:
                del self.pending[sid]

    def uncopied(self) -> bool:
        """Does a pending snapshot still hold a tensor by reference (not yet given its private copy)? Forgets the
        snapshots that are gone on the way. A writer with nothing to protect then skips listing its tensors."""
        with self.lock:
            return any(entry[2] is None for snap in self._live() for entry in snap.held.values())

    def protect(self, tensors: Iterable[torch.Tensor]) -> int:
        """Before `tensors` are written: give every pending snapshot that references their storage a private copy.
        Returns the number of tensors copied."""
        if not self.pending or not self.uncopied():
            return 0
        keys = {k for k in map(_storage_key, tensors) if k is not None}
        if not keys:
            return 0

        def shares_storage(entry: list[Any]) -> bool:
            if entry[3] is None:
                entry[3] = _storage_key(entry[0])
            return entry[3] in keys

        return self._copy_where(shares_storage)

    def protect_all(self) -> int:
        """When capture stops (debugger.stop()): the training's code that follows is not seen by the mode. What
        such code changes in place is the model's parameters and their gradients (a manual `p -= lr * p.grad`, a
        custom optimizer, `p.grad.zero_()`), so the references not yet serialised to parameters (leaves that
        require grad) and to their gradients get a private copy now. Activations and other gradients are left as
        they are: nothing in a training loop writes them after the step, and copying them all here cost as much as
        the step itself (a mid-size transformer: ~0.9 GB a step). Should code outside the mode write one anyway,
        its record is not sent with the changed value (the version check) but goes out skipped, with the reason.
        Returns the number of tensors copied."""
        if not self.pending:
            return 0
        grads = set()
        with self.lock:
            for ref in list(self.pending.values()):
                snap = ref()
                for entry in snap.held.values() if snap is not None else ():
                    t = entry[0]
                    if t.is_leaf and t.requires_grad and t.grad is not None:
                        key = _storage_key(t.grad)
                        if key is not None:
                            grads.add(key)

        def parameter_or_gradient(entry: list[Any]) -> bool:
            t = entry[0]
            if tensor_version(t) != entry[1]:
                return False   # changed already: the version check skips its record; a copy now would be wrong
            if t.is_leaf and t.requires_grad:
                return True
            if not grads:
                return False
            if entry[3] is None:
                entry[3] = _storage_key(t)
            return entry[3] in grads

        return self._copy_where(parameter_or_gradient)

    def _copy_where(self, wanted: Callable[[list[Any]], bool]) -> int:
        """Give a private copy to every held, not yet copied tensor of the pending snapshots for which `wanted` is
        true; forget snapshots that are gone. Returns the number of tensors copied."""
        n = 0
        with self.lock, disable_torch_function(), torch.no_grad():
            for snap in self._live():
                for entry in snap.held.values():
                    if entry[2] is None and wanted(entry):
                        t = entry[0]
                        entry[2] = t.detach().clone(memory_format=torch.preserve_format)
                        n += 1
                        self.copied_bytes += t.numel() * t.element_size()
            self.copied += n
        return n

    def protect_tree(self, obj: Any) -> int:
        return self.protect(list(iter_tensors(obj))) if self.pending else 0

    def begin(self, snap: Snapshot) -> list[tuple[int, torch.Tensor]]:
        """Sender thread, before serialising: [(id, tensor to read)] (the private copy where one was made)."""
        with self.lock:
            return [(tid, e[2] if e[2] is not None else e[0]) for tid, e in snap.held.items()]

    def finish(self, snap: Snapshot, read: list[tuple[int, torch.Tensor]]) -> tuple[dict[int, torch.Tensor], list[int]]:
        """Sender thread, after reading `read`: ({id: copy} to read again, [ids changed without a copy]); the
        snapshot leaves the registry and drops its references."""
        again: dict[int, torch.Tensor] = {}
        changed: list[int] = []
        with self.lock:
            for tid, src in read:
                e = snap.held[tid]
                if e[2] is not None:
                    if src is not e[2]:
                        again[tid] = e[2]
                elif tensor_version(e[0]) != e[1]:
                    changed.append(tid)
            self.pending.pop(id(snap), None)
            self.changed += len(changed)
        return again, changed


HELD = HeldRefs()


def _hold(obj: Any, held: dict[int, list[Any]], grads: set[int], copy: bool) -> Any:
    tp = type(obj)
    if tp is tuple or tp is list:
        if not obj:
            return obj
        if not copy:   # the common case, a flat sequence of tensors and scalars: no call per item
            items: list[Any] = []
            for v in obj:
                if isinstance(v, _Tensor):
                    tid = id(v)
                    if tid not in held:
                        held[tid] = [v, tensor_version(v), None, None]
                        if v.requires_grad:
                            grads.add(tid)
                    items.append(v)
                elif isinstance(v, (tuple, list, dict, slice)):
                    items.append(_hold(v, held, grads, copy))
                else:
                    items.append(v)
        else:
            items = [_hold(v, held, grads, copy) for v in obj]
        return items if tp is list else tuple(items)
    if isinstance(obj, _Tensor):
        tid = id(obj)
        if copy:
            c = obj.detach().clone()
            if grads is not None and obj.requires_grad:
                grads.add(id(c))
            return c
        if tid not in held:
            held[tid] = [obj, tensor_version(obj), None, None]
            if grads is not None and obj.requires_grad:
                grads.add(tid)
        return obj
    if isinstance(obj, (tuple, list)):   # named tuples, torch.return_types: plain tuples (protos.trees)
        return _hold(tuple(obj) if isinstance(obj, tuple) else list(obj), held, grads, copy)
    if isinstance(obj, dict):
        return {k: _hold(v, held, grads, copy) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(_hold(obj.start, held, grads, copy), _hold(obj.stop, held, grads, copy),
                     _hold(obj.step, held, grads, copy))
    return obj


def snapshot(obj: Any, copy: bool = False) -> Snapshot:
    """Hold `obj`'s tensors by reference (copy=False) or as private clones taken now (copy=True: the inputs of a
    call that writes them)."""
    held: dict[int, list[Any]] = {}
    grads: set[int] = set()
    if copy:
        with disable_torch_function():
            tree = _hold(obj, held, grads, True)
        nbytes = sum(t.numel() * t.element_size() for t in iter_tensors(tree))
    elif type(obj) is _Tensor or isinstance(obj, _Tensor):   # a single output: the common case
        tree = obj
        held[id(obj)] = [obj, tensor_version(obj), None, None]
        if obj.requires_grad:
            grads.add(id(obj))
        nbytes = obj.numel() * obj.element_size()
    else:
        tree = _hold(obj, held, grads, False)
        nbytes = 0
        for e in held.values():
            t = e[0]
            nbytes += t.numel() * t.element_size()
    snap = Snapshot(tree, nbytes, grads, held)
    HELD.add(snap)
    return snap


NESTED = 2
# type -> 1: a tensor, NESTED: a container the argument walks descend into (tuple, list, dict, slice), 0: anything
# else. Looked up by the argument's type: isinstance(v, torch.Tensor) is slow for a scalar (torch's metaclass).
# Shared with npu_agent/backward.py's argument walk.
KIND_OF: dict[type, int] = {}


def arg_kind(tp: type) -> int:
    """The KIND_OF entry of type `tp`, computed and remembered."""
    if len(KIND_OF) > 1024:   # types made at run time: keep the table bounded
        KIND_OF.clear()
    kind = KIND_OF[tp] = (1 if issubclass(tp, _Tensor) else
                          NESTED if issubclass(tp, (tuple, list, dict, slice)) else 0)
    return kind


def without_tensors(seq: Any) -> bool:
    """`seq` is a plain tuple or list (or a torch.Size) whose items are neither tensors nor containers: a shape, a
    list of dims. Such an argument holds nothing for a record to hold or a backward tap to tap."""
    if type(seq) not in _FLAT_SEQUENCES:
        return False
    kinds = KIND_OF
    for v in seq:
        kind = kinds.get(type(v))
        if kind is None:
            kind = arg_kind(type(v))
        if kind:
            return False
    return True


_FLAT_SEQUENCES = (tuple, list, torch.Size)
# The types whose values a call's signature keeps as they are (npu_agent/backward.py's argument read; a float by
# whether it is 0, any other type by itself).
VALUE_KEYS = frozenset({bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def use_compiled() -> None:
    """`snapshot_call` reads its arguments, and `take_grads` holds a list of gradients, in C from now on where
    npu_agent/_fasttap.c is built (npu_agent.compiled), else in Python (a Capturer calls it when it is made). The C
    `hold` reads this module's KIND_OF, arg_kind and without_tensors at each call, as `_hold_flat` does, and `grads`
    its Snapshot and HELD."""
    global _read_flat, take_grads
    from npu_agent.compiled import TAP

    module = TAP.load()
    if module is None:
        _read_flat, take_grads = _hold_flat, grads_snapshot
        return
    module.bind("hold", globals())
    _read_flat, take_grads = module.hold, module.grads


def snapshot_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Snapshot:
    """`snapshot((args, kwargs))`, the same tree held the same way, for the common call: positional arguments in a
    plain tuple and keyword arguments that are tensors, scalars or plain tuples of scalars (a shape), walked without
    a call per item (a call with other nested arguments takes `snapshot`'s walk). The tuple of positional arguments
    is kept as it is, and so is a plain tuple of scalars in it (immutable: `snapshot` would rebuild it equal)."""
    if type(args) is not tuple:
        return snapshot((args, kwargs))
    held: dict[int, list[Any]] = {}
    grads: set[int] = set()
    nbytes = _read_flat(args, kwargs, held, grads)
    if nbytes is None:
        return snapshot((args, kwargs))
    snap = Snapshot((args, dict(kwargs)), nbytes, grads, held)
    HELD.add(snap)
    return snap


def _hold_flat(args: tuple[Any, ...], kwargs: dict[str, Any], held: dict[int, list[Any]], grads: set[int]
               ) -> int | None:
    """`snapshot_call`'s read of the arguments: each tensor into `held` (id -> [tensor, its version, None, None]) and,
    if it requires grad, its id into `grads`; returns the bytes held, or None at a nested argument other than a plain
    tuple without tensors (`snapshot`'s walk holds it). npu_agent/_fasttap.c's `hold` does the same in C."""
    kinds = KIND_OF
    nbytes = 0
    for values in (args, kwargs.values()) if kwargs else (args,):
        for v in values:
            kind = kinds.get(type(v))
            if kind is None:
                kind = arg_kind(type(v))
            if kind == 1:
                tid = id(v)
                if tid not in held:
                    held[tid] = [v, tensor_version(v), None, None]
                    if v.requires_grad:
                        grads.add(tid)
                    nbytes += v.numel() * v.element_size()
            elif kind == NESTED and (type(v) is not tuple or not without_tensors(v)):
                return None
    return nbytes


# snapshot_call's read of the arguments: `_hold_flat`, or npu_agent/_fasttap.c's `hold` once `use_compiled()` found it
_read_flat: Callable[[tuple[Any, ...], dict[str, Any], dict[int, list[Any]], set[int]], int | None] = _hold_flat


def grads_snapshot(values: list[torch.Tensor | None]) -> Snapshot:
    """A list of gradients (None where none arrived), held by reference. npu_agent/_fasttap.c's `grads` does the
    same in C (`take_grads`)."""
    held: dict[int, list[Any]] = {}
    nbytes = 0
    for v in values:
        if v is not None and id(v) not in held:
            held[id(v)] = [v, tensor_version(v), None, None]
            nbytes += v.numel() * v.element_size()
    snap = Snapshot(list(values), nbytes, set(), held)
    HELD.add(snap)
    return snap


# grads_snapshot, or npu_agent/_fasttap.c's `grads` once `use_compiled()` found it (a backward record's two lists)
take_grads: Callable[[list[torch.Tensor | None]], Snapshot] = grads_snapshot


# -- mutations the capture mode does not see ---------------------------------------------------------------------
_installed = False
_install_lock = threading.Lock()


def _optimizer_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The tensors the optimizer's step writes, listed only as HELD.protect reads them (it reads none where no
    pending snapshot holds a tensor by reference)."""
    for group in opt.param_groups:
        for p in group["params"]:
            yield p
            if p.grad is not None:
                yield p.grad
            for v in opt.state.get(p, {}).values():
                if isinstance(v, _Tensor):
                    yield v


def _before_optimizer_step(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if HELD.pending:
        try:
            HELD.protect(_optimizer_tensors(opt))
        except Exception:  # noqa: BLE001 - never into the training; the version check still guards the records
            pass


def install() -> None:
    """Protect held references from `optimizer.step()` and `zero_grad(set_to_none=False)` (once per process)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_optimizer_step)
        for cls in (torch.optim.Optimizer, torch.nn.Module):
            original = cls.zero_grad

            def zero_grad(self: Any, set_to_none: bool = True, _original: Callable[..., None] = original,
                          _module: bool = cls is torch.nn.Module) -> None:
                if not set_to_none and HELD.pending:
                    try:
                        params = self.parameters() if _module else (p for g in self.param_groups
                                                                       for p in g["params"])
                        HELD.protect(p.grad for p in params if p.grad is not None)   # (read only if needed)
                    except Exception:  # noqa: BLE001
                        pass
                return _original(self, set_to_none)

            zero_grad.__doc__ = original.__doc__
            setattr(cls, "zero_grad", zero_grad)  # noqa: B010 - patching a method: mypy rejects `cls.zero_grad =`
        _installed = True
