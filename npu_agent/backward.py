"""Backward records per API call (docs/design.md §4): taps on inputs, hooks on outputs, checkpoint recomputes.

For a call under grad mode, each differentiable input is passed to the API through a private `view_as` alias with
a pre-hook on its autograd node: the alias is this call's own edge to the tensor, so its gradient is exactly this
call's grad_input, also when the tensor is used elsewhere (residuals, tied weights). One pre-hook on each output's
node gives grad_output. Where the call is one autograd node whose every input edge is one of its aliases (most
calls: elementwise ops, views, matmul, ...), one hook after that node takes grad_output and every grad_input at
once, the same tensors the per-tensor hooks would get; it is registered in tap_outputs, once the node is known (a
hook registration costs the training thread a few us). Hooks hold the gradients by reference (a parameter's
gradient is copied: it may become the parameter's .grad, which later code changes in place); they never return a
tensor, so no gradient is replaced.

A call whose signature made such a node before, or a small tree of nodes down to its aliases (a composite such as
a linear on a 3-D input), is given no aliases at all (`BackwardTaps.known`, docs/design.md §4): its nodes' edges
are checked against its own inputs after the call, then hooked the same way.

A backward record is emitted when every tapped input got its gradient, or at the end of the backward pass (an
engine callback) with what arrived. Calls whose outputs never got a gradient are closed at the step boundary
with an empty backward record, so the server can finish their result rows.

Reentrant activation checkpointing runs the region's forward under no_grad and recomputes it inside backward,
where the capture mode is not active. `install_checkpoint_support()` wraps the region function so that the first
pass holds its forward records and the recompute re-enters the mode with the same names, installing the taps that
the real graph uses. Non-reentrant checkpointing keeps the taps of the first pass and needs nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from npu_agent import snapshot
from npu_agent.records import BACKWARD, PendingRecord
from npu_agent.snapshot import (
    KIND_OF,
    NESTED,
    VALUE_KEYS,
    Snapshot,
    arg_kind,
    grads_snapshot,
    iter_tensors,
    map_tensors,
    without_tensors,
)
from protos.torch_compat import disable_torch_function, queue_backward_callback

log = logging.getLogger("npu_agent")

if TYPE_CHECKING:
    from npu_agent.capture import CallContext


@dataclasses.dataclass(slots=True)
class _Entry:
    name: str
    step: int
    positions: list[int]                 # flattened input position of each tapped slot
    grad_in: list[Any]
    grad_out: list[Any] = dataclasses.field(default_factory=list)
    leaf: list[bool] = dataclasses.field(default_factory=list)   # per slot: the input is a leaf (a parameter)
    left: int = 0
    emitted: bool = False
    module: str = ""                     # where the forward call was made (npu_agent.location)
    source: str = ""
    signature: Any = None                # the call's _tap_flat signature, while its graph may be learned


def _copy_py(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A private copy of a gradient (a parameter's: `_arrived`). npu_agent/_fasthook.cpp's `copy_grad` makes the
    same in C++."""
    if grad is None:
        return None
    with disable_torch_function():
        return grad.detach().clone()


def _hold(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient on its way through the graph, held by reference (the same tensor object, so that its use count
    shows our reference): the engine accumulates in place, and AccumulateGrad adopts a gradient as a parameter's
    .grad without a copy, only when it holds the last reference."""
    return grad


_Tensor = torch.Tensor


def _map_flat(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """map_tensors for the common case of a tuple/list of leaves (fn sees every leaf and keeps non-tensors)."""
    tp = type(obj)
    if tp is tuple or tp is list:
        for v in obj:
            if isinstance(v, (tuple, list, dict, slice)):
                return map_tensors(obj, fn)
        items = [fn(v) for v in obj]
        return items if tp is list else tuple(items)
    if isinstance(obj, (tuple, list, dict, slice)):
        return map_tensors(obj, fn)
    return fn(obj)


class BackwardTaps:
    def __init__(self, sink: Callable[[PendingRecord], object]):
        self.sink = sink
        self._pending: dict[tuple[int, str], _Entry] = {}
        self._lock = threading.Lock()
        self._flush_queued = False
        # calls tapped without aliases (below `_direct_edges`): signature -> the tree of nodes its calls make, and
        # the signatures whose graph was once another (aliases always)
        self.known: dict[tuple[Any, ...], _Tree] = {}
        self.mixed: set[tuple[Any, ...]] = set()
        use_compiled()   # a call's flat arguments read, its known tree checked: in C where built

    # -- forward side (training thread, inside the capture mode's handler) ---------------------------------
    def tap_inputs(self, ctx: CallContext) -> None:
        """Replace each differentiable input by a hooked alias; remember the slots on `ctx.taps`."""
        rec = ctx.record
        if not ctx.recompute and rec.inputs is not None and not rec.inputs.requires_grad:
            return   # no input requires grad: nothing to tap, no walk
        # the common case: tensors, scalars and shapes, positional or keyword, no tensor inside a container
        if type(ctx.args) is not tuple or not self._tap_flat(ctx, rec, ctx.args, ctx.kwargs):
            self._tap_tree(ctx, rec)

    def _tap_flat(self, ctx: CallContext, rec: PendingRecord, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """tap_inputs for flat arguments (a tuple of positional ones, then the keyword ones, in the order the
        server flattens them): the same slots, aliases and hooks as `_tap_tree`, without a call per argument.
        False, with nothing done, at a nested argument that may hold tensors (a list of tensors, a dict, a slice;
        not a shape).

        A call whose signature (the API, the autocast state, each argument's kind, and each tensor's dtype,
        dimensions and whether it is tapped) made a known tree of nodes before (`known`: one node straight on its
        aliases, or a composite's few) is not given aliases: `tap_outputs` checks that those nodes' edges lead to
        the inputs themselves, and hooks them."""
        signature: list[Any] = [ctx.category, ctx.api, rec.autocast, len(args)]
        first = args[0] if rec.inplace and args and isinstance(args[0], _Tensor) else None
        tapped = _scan(args, kwargs, signature)
        if tapped is None:
            return False
        if not tapped:
            return True
        entry = _Entry(rec.name, rec.step, [], [], module=rec.module, source=rec.source)
        sig: tuple[Any, ...] | None = None   # while set, tap_outputs learns what this call's nodes are
        if first is None and not ctx.recompute:
            sig = tuple(signature)
            known = self.known.get(sig) if ALIAS_FREE else None
            if known is not None:
                inputs = []
                for _, t, pos in tapped:
                    entry.positions.append(pos)
                    entry.grad_in.append(None)
                    entry.leaf.append(t.is_leaf)
                    inputs.append(t)
                entry.left = len(entry.positions)
                ctx.taps = (entry, {}, _Known(sig, known, inputs))
                return True
            if sig in self.mixed:
                sig = None   # aliases always: nothing to learn, its nodes are not walked again
        items: list[Any] | None = None
        named: dict[str, Any] | None = None
        aliases: dict[int, torch.Tensor] = {}
        nodes: list[tuple[Any, int]] = []   # (alias node, slot): hooked by tap_outputs
        hooked: list[tuple[torch.Tensor, int]] = []   # in-place `self`: a tensor hook (`_in_grad`)
        for key, t, pos in tapped:
            slot = len(entry.positions)
            if first is not None and t is first:
                # `self` of an in-place op must be mutated itself; a hook registered before the op sees the
                # gradient with respect to the value the op read. A leaf cannot be modified in place anyway.
                if t.is_leaf:
                    continue
                entry.positions.append(pos)
                entry.grad_in.append(None)
                entry.leaf.append(False)
                hooked.append((t, slot))
                continue
            alias = t.view_as(t)
            node = alias.grad_fn
            if node is None:   # grad mode off (view_as records no node): nothing to tap
                continue
            nodes.append((node, slot))
            entry.positions.append(pos)
            entry.grad_in.append(None)
            entry.leaf.append(t.is_leaf)
            aliases[id(alias)] = t
            if isinstance(key, int):
                if items is None:
                    items = list(args)
                items[key] = alias
            else:
                if named is None:
                    named = dict(kwargs)
                named[cast(str, key)] = alias
        if entry.positions:
            for t, slot in hooked:
                t.register_hook(functools.partial(self._in_grad, entry, slot, False))
            entry.left = len(entry.positions)
            if items is not None:
                ctx.args = tuple(items)
            if named is not None:
                ctx.kwargs = named
            entry.signature = sig
            ctx.taps = (entry, aliases, nodes)
        return True

    def _tap_tree(self, ctx: CallContext, rec: PendingRecord) -> None:
        """tap_inputs for any tree of arguments (nested lists, tensor keyword arguments)."""
        first = ctx.args[0] if ctx.args and isinstance(ctx.args[0], torch.Tensor) else None
        entry = _Entry(rec.name, rec.step, [], [], module=rec.module, source=rec.source)
        position = -1
        aliases: dict[int, torch.Tensor] = {}
        nodes: list[tuple[Any, int]] = []   # (alias node, slot): hooked by tap_outputs

        def tap(t: Any) -> Any:
            nonlocal position
            if not isinstance(t, torch.Tensor):
                return t
            position += 1
            if not (t.requires_grad and (t.is_floating_point() or t.is_complex())):
                return t
            slot = len(entry.positions)
            if rec.inplace and t is first:
                # `self` of an in-place op must be mutated itself; a hook registered before the op sees the
                # gradient with respect to the value the op read. A leaf cannot be modified in place anyway.
                if t.is_leaf:
                    return t
                entry.positions.append(position)
                entry.grad_in.append(None)
                entry.leaf.append(False)
                t.register_hook(functools.partial(self._in_grad, entry, slot, False))
                return t
            alias = t.view_as(t)
            node = alias.grad_fn
            if node is None:   # grad mode off (view_as records no node): nothing to tap
                return t
            nodes.append((node, slot))
            entry.positions.append(position)
            entry.grad_in.append(None)
            entry.leaf.append(t.is_leaf)
            aliases[id(alias)] = t
            return alias

        args = _map_flat(ctx.args, tap)
        kwargs = {k: _map_flat(v, tap) for k, v in ctx.kwargs.items()} if ctx.kwargs else ctx.kwargs
        if entry.positions:
            entry.left = len(entry.positions)
            ctx.args, ctx.kwargs = args, kwargs
            ctx.taps = (entry, aliases, nodes)

    def hook_inputs(self, ctx: CallContext) -> None:
        """The pre-hooks on the aliases' nodes, for a call whose outputs are not hooked (tap_outputs not called)."""
        entry, _, nodes = ctx.taps
        if type(nodes) is not _Known:   # (a call without aliases has nothing to hook before its node)
            self._hook_aliases(entry, nodes)

    def _hook_aliases(self, entry: _Entry, nodes: list[tuple[Any, int]]) -> None:
        for node, slot in nodes:
            _pre_hook(node, self._in_grad, entry, slot, True)
        nodes.clear()

    def tap_outputs(self, ctx: CallContext, out: Any) -> Any:
        """Hook every differentiable output; give back the original tensor where the API returned our alias.

        The common call, one autograd node whose every input edge is one of the call's aliases: one hook after that
        node (`_node_grads`) takes grad_output and every grad_input at once, the very tensors the pre-hooks on its
        output node and on the aliases' nodes would get, in place of one hook per tensor. Any other call (several
        output nodes, a cast or a composite's inner node between an alias and the output's node, an in-place call's
        tensor hook): a pre-hook on each alias's node and on each output's node."""
        entry, aliases, alias_nodes = ctx.taps
        if type(alias_nodes) is _Known:
            return self._tap_known(ctx, entry, alias_nodes, out)
        if isinstance(out, _Tensor):   # the common case: one tensor
            if aliases:
                out = aliases.get(id(out), out)
            entry.grad_out = [None]
            fn = out.grad_fn
            if fn is None or not out.requires_grad:
                self._hook_aliases(entry, alias_nodes)
                return out
            if entry.signature is not None:   # (before the aliases' nodes are hooked and forgotten below)
                self._learn(entry.signature, _tree_of(fn, alias_nodes, len(entry.positions)))
            edges = _direct_edges(fn, alias_nodes, len(entry.positions))
            if edges is not None:
                _post_hook(fn, self._node_grads, entry, out.output_nr, edges)
                alias_nodes.clear()
            else:
                self._hook_aliases(entry, alias_nodes)
                _pre_hook(fn, self._out_grads, entry, [(out.output_nr, 0)])
            self._expect_backward(ctx, entry)
            return out
        self._hook_aliases(entry, alias_nodes)
        if aliases:
            out = map_tensors(out, lambda t: aliases.get(id(t), t))
        self._hook_outputs(ctx, entry, out)
        return out

    def _hook_outputs(self, ctx: CallContext, entry: _Entry, out: Any) -> None:
        """A pre-hook on the node of each differentiable output (grad_output), the call pending its gradients."""
        outs = list(iter_tensors(out))
        entry.grad_out = [None] * len(outs)
        # one pre-hook per autograd node, for all its outputs we return: id(node) -> (node, [(output_nr, j)])
        nodes: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for j, o in enumerate(outs):
            fn = o.grad_fn
            if fn is not None and o.requires_grad:
                nodes.setdefault(id(fn), (fn, []))[1].append((o.output_nr, j))
        for fn, slots in nodes.values():
            _pre_hook(fn, self._out_grads, entry, slots)
        if nodes:
            self._expect_backward(ctx, entry)

    def _expect_backward(self, ctx: CallContext, entry: _Entry) -> None:
        """The call's outputs are hooked: its record says a backward record will come, and the entry waits for it."""
        ctx.record.backward_expected = True
        with self._lock:
            self._pending[(entry.step, entry.name)] = entry

    def _tap_known(self, ctx: CallContext, entry: _Entry, known: _Known, out: Any) -> Any:
        """tap_outputs for a call given no aliases (its signature made a known tree of nodes before): a hook after
        each of those nodes that has an edge to an input and after the output's node, once every edge is checked
        to lead to the inputs themselves (`_Known.hooks_of`). A call whose graph is not that one (an output that is
        an input, several outputs, another node, an edge to something else) gets pre-hooks on its outputs' nodes
        only, as a call whose aliases no gradient reaches: its backward record comes without input gradients. Its
        signature takes aliases from then on."""
        if isinstance(out, _Tensor):
            if not out.requires_grad or out.grad_fn is None:
                return out   # (as with aliases: nothing of this call is differentiated)
            fn = out.grad_fn
            hooks = known.hooks_of(fn, entry.leaf)
            if hooks is not None:
                entry.grad_out = [None]
                _post_hook(fn, self._node_grads, entry, out.output_nr, hooks[0][1])
                for node, edges in hooks[1:]:   # a composite's inner nodes with edges to inputs: no grad_output
                    _post_hook(node, self._node_grads, entry, -1, edges)
                self._expect_backward(ctx, entry)
                return out
        self._unlearn(known.signature, f"{ctx.record.name} (step {ctx.record.step})")
        self._hook_outputs(ctx, entry, out)
        return out

    def _learn(self, signature: tuple[Any, ...], tree: _Tree | None) -> None:
        """Remember the nodes calls with `signature` make (`_tree_of`); without such a tree, that its calls take
        aliases (no walk is tried again)."""
        if len(self.known) >= _KNOWN_LIMIT:
            self.known.clear()
        if len(self.mixed) >= _KNOWN_LIMIT:
            self.mixed.clear()
        if tree is None:
            self.mixed.add(signature)
        elif signature not in self.mixed:
            self.known[signature] = tree

    def _unlearn(self, signature: tuple[Any, ...], name: str) -> None:
        self.known.pop(signature, None)
        if signature not in self.mixed:
            self.mixed.add(signature)
            log.warning("online check: the autograd graph of %s is not the one earlier calls with the same arguments "
                        "made; its backward record goes without input gradients, and such calls are tapped through "
                        "aliases from now on", name)

    # -- backward side (autograd engine threads) ------------------------------------------------------------
    # Each hook is one of the three methods below with the call's entry (and where the gradients are) bound to it:
    # `_post_hook(node, self._node_grads, entry, nr, edges)` calls `self._node_grads(entry, nr, edges, grad_inputs,
    # grad_outputs)` (no closure made for each call).
    def _out_grads(self, entry: _Entry, slots: list[tuple[int, int]], grads: tuple[Any, ...]) -> None:
        """A pre-hook on an output's node: each (output number on the node, output index)'s grad_output."""
        with self._lock:
            if not entry.emitted:
                for nr, j in slots:
                    if entry.grad_out[j] is None and nr < len(grads):
                        entry.grad_out[j] = _hold(grads[nr])

    def _node_grads(self, entry: _Entry, nr: int, edges: Sequence[tuple[int, int]], grad_inputs: tuple[Any, ...],
                    grad_outputs: tuple[Any, ...]) -> None:
        """The one hook after the output's node (tap_outputs): grad_output (`nr`: the output's number on the node)
        as `_out_grads` takes it, then each (edge, slot)'s gradient as the alias's `_in_grad` takes it. With `nr` -1,
        a hook after a composite's inner node (`_tap_known`): its edges' gradients only."""
        emit = False
        with self._lock:
            if entry.emitted:
                return
            if nr >= 0 and entry.grad_out[0] is None and nr < len(grad_outputs):
                entry.grad_out[0] = _hold(grad_outputs[nr])
            for i, slot in edges:
                if entry.grad_in[slot] is not None:
                    continue   # retain_graph double backward: the first gradient is the record
                emit = self._arrived(entry, slot, grad_inputs[i])
                if entry.left == 0:
                    break
            queue = self._queue_flush()
        self._after(entry, emit, queue)

    def _in_grad(self, entry: _Entry, slot: int, pre: bool, grad: Any) -> None:
        """The hook for one tapped input: a tensor hook (grad) or, with `pre`, a pre-hook on the alias's node
        (a tuple holding grad)."""
        if pre:
            grad = grad[0]
        emit = False
        with self._lock:
            if entry.emitted or entry.grad_in[slot] is not None:
                return  # retain_graph double backward: the first gradient is the record
            emit = self._arrived(entry, slot, grad)
            queue = self._queue_flush()
        self._after(entry, emit, queue)

    def _arrived(self, entry: _Entry, slot: int, grad: Any) -> bool:
        """Under the lock: input `slot`'s gradient arrived; True when this caller must now emit the entry."""
        # A parameter's gradient may become its .grad without a copy (AccumulateGrad steals a view of it), which
        # later steps, clipping or zero_grad change in place: copied now.
        entry.grad_in[slot] = _copy(grad) if entry.leaf[slot] else _hold(grad)
        entry.left -= 1
        return entry.left == 0 and self._take(entry)

    def _queue_flush(self) -> bool:
        """Under the lock: whether this hook must queue the end-of-backward flush (once per backward pass)."""
        queue = not self._flush_queued
        self._flush_queued = True
        return queue

    def _after(self, entry: _Entry, emit: bool, queue: bool) -> None:
        """Outside the lock, after a hook took its gradients: emit the entry, queue the flush."""
        if emit:
            self._emit(entry)
        if queue:
            try:
                queue_backward_callback(self._end_of_backward)
            except RuntimeError:
                with self._lock:
                    self._flush_queued = False

    def _take(self, entry: _Entry) -> bool:
        """Under the lock: mark the entry emitted; True if this caller must emit it."""
        if entry.emitted:
            return False
        entry.emitted = True
        self._pending.pop((entry.step, entry.name), None)
        return True

    def _end_of_backward(self) -> None:
        """After a backward pass: emit the calls that got some, but not all, of their gradients."""
        with self._lock:
            self._flush_queued = False
            ready = [e for e in list(self._pending.values()) if any(g is not None for g in e.grad_in) and self._take(e)]
        for e in ready:
            self._emit(e)

    def _emit(self, entry: _Entry) -> None:
        rec = PendingRecord(
            name=entry.name, step=entry.step, direction=BACKWARD,
            grad_output=snapshot.take_grads(entry.grad_out), grad_input=snapshot.take_grads(entry.grad_in),
            grad_input_positions=tuple(entry.positions), grad_enabled=True, module=entry.module, source=entry.source,
        )
        self.sink(rec)

    def end_step(self) -> None:
        """Step boundary: close calls that never got a gradient (an empty backward record each)."""
        with self._lock:
            rest = [e for e in list(self._pending.values()) if self._take(e)]
        for e in rest:
            if any(g is not None for g in e.grad_in):
                self._emit(e)
            else:
                self.sink(PendingRecord(name=e.name, step=e.step, direction=BACKWARD, grad_enabled=True,
                                        grad_input=_snap([]), module=e.module, source=e.source))


# -- calls tapped without aliases ------------------------------------------------------------------------------------
# A call whose output's autograd node has every tapped input as a direct edge (`_direct_edges`) gets its input
# gradients from the hook after that node; its aliases only told which edge is which input. Each alias costs the
# training about 5 us (view_as in the forward, one more node for the engine in the backward). So the edges are
# remembered by the call's signature (`_tap_flat`), and a later call with that signature is given no aliases: its
# node's edges are checked against its own tensors (`_Known.hooks_of`) before the hook goes on. A composite whose
# nodes form a small tree down to its aliases is learned the same way (`_tree_of`).
ALIAS_FREE = True          # False: every call takes aliases (tests compare both)
_KNOWN_LIMIT = 4096   # signatures remembered (BackwardTaps.known) before they are forgotten at once


# What a signature's calls make (`_tree_of`): their nodes, the output's first, then breadth first, each as (the index
# of the node whose edge leads to it (-1: the output's), that edge, its edge count, its edges that are not None,
# its (edge, slot) pairs that lead to a tapped input)
_Tree = tuple[tuple[int, int, int, int, tuple[tuple[int, int], ...]], ...]
_TREE_NODES = 8   # the most nodes of one call followed from its output's node


def _tree_of(fn: Any, alias_nodes: list[tuple[Any, int]], slots: int) -> _Tree | None:
    """The nodes between the output's node `fn` and the call's aliases, when they form a tree of at most
    _TREE_NODES nodes in which every tapped slot's alias is reached by exactly one edge (so that the gradient along
    that edge is the whole of the call's gradient for that input); None otherwise (an input read twice inside the
    call, an edge out of the call's own nodes)."""
    if not alias_nodes or len(alias_nodes) != slots:
        return None
    slot_of = {id(node): slot for node, slot in alias_nodes}
    tree: list[tuple[int, int, int, int, tuple[tuple[int, int], ...]]] = []
    seen: set[int] = set()
    queue = [(fn, -1, 0)]
    while queue:
        node, parent, j = queue.pop(0)
        if id(node) in seen or len(tree) >= _TREE_NODES:
            return None
        seen.add(id(node))
        nf = node.next_functions
        k = len(tree)
        edges: list[tuple[int, int]] = []
        count = 0
        for i, (child, _) in enumerate(nf):
            if child is None:
                continue
            count += 1
            slot = slot_of.get(id(child))
            if slot is not None:
                edges.append((i, slot))
            else:
                queue.append((child, k, i))
        tree.append((parent, j, len(nf), count, tuple(edges)))
    if sorted(slot for *_, edges in tree for _, slot in edges) != list(range(slots)):
        return None
    return tuple(tree)


class _Known:
    """The taps of a call given no aliases: its signature, the learned tree of nodes (`_Tree`) and its tapped input
    tensors by slot."""

    __slots__ = ("signature", "tree", "inputs")

    def __init__(self, signature: tuple[Any, ...], tree: _Tree, inputs: list[torch.Tensor]):
        self.signature = signature
        self.tree = tree
        self.inputs = inputs

    def hooks_of(self, fn: Any, leaf: list[bool]) -> _Hooks | None:
        """[(node, its (edge, slot) pairs)] for the output's node `fn` and for each inner node with edges to inputs,
        when the nodes from `fn` on are the learned tree and each such edge leads to this call's input of its slot
        (a leaf's AccumulateGrad node, another tensor's own node and output number); else None (`_hooks_of`)."""
        return _hooks_of(self.tree, fn, self.inputs, leaf)


# (argument key, tensor, flattened position) of each tapped input
_Tapped = list[tuple[Any, torch.Tensor, int]]


def _scan_py(args: tuple[Any, ...], kwargs: dict[str, Any], signature: list[Any]) -> _Tapped | None:
    """Read a call's flat arguments (`_tap_flat`: the positional ones, then the keyword ones): append each one's part
    of the call's signature to `signature`, and return the tensors to tap; None, at a nested argument that may hold
    tensors. npu_agent/_fasttap.c's `scan` does the same in C (`use_compiled`)."""
    tapped: _Tapped = []
    position = -1
    kinds = KIND_OF
    for key, t in itertools.chain(enumerate(args), kwargs.items()) if kwargs else enumerate(args):
        tp = type(t)
        kind = kinds.get(tp)
        if kind is None:
            kind = arg_kind(tp)
        if kind != 1:
            if kind == NESTED and not without_tensors(t):   # a shape or a list of dims has nothing to tap
                return None
            # the overload and the backend a call takes may depend on these (a Scalar or a Tensor, a dropout
            # probability of 0): a number by whether it is 0, so that a changing factor (a learning rate) does
            # not make every call new
            signature.append(t if tp in VALUE_KEYS else (t == 0) if tp is float else tp)
            continue
        position += 1
        tap = t.requires_grad and (t.is_floating_point() or t.is_complex())
        signature.append((key, tap, t.dtype, t.dim()))
        if tap:
            tapped.append((key, t, position))
    return tapped


_Hooks = list[tuple[Any, tuple[tuple[int, int], ...]]]


def _hooks_of_py(tree: _Tree, fn: Any, inputs: list[torch.Tensor], leaf: list[bool]) -> _Hooks | None:
    """`_Known.hooks_of` (below). npu_agent/_fasttap.c's `hooks_of` does the same in C."""
    found: list[Any] = []   # each tree node's next_functions
    hooks = []
    for parent, j, size, count, edges in tree:
        node = fn if parent < 0 else found[parent][j][0]
        if node is None:
            return None
        nf = node.next_functions
        if len(nf) != size or sum(n is not None for n, _ in nf) != count:
            return None
        for i, slot in edges:
            edge, nr = nf[i]
            t = inputs[slot]
            if leaf[slot]:
                if getattr(edge, "variable", None) is not t:
                    return None
            elif edge is None or edge is not t.grad_fn or nr != t.output_nr:
                return None
        found.append(nf)
        if edges or parent < 0:
            hooks.append((node, edges))
    return hooks


def _post_hook_py(node: Any, fn: Callable[..., None], *args: Any) -> None:
    """fn(*args, grad_inputs, grad_outputs) after `node` runs in a backward pass (the handle is not kept: never
    removed)."""
    node.register_hook(functools.partial(fn, *args) if args else fn)


def _pre_hook_py(node: Any, fn: Callable[..., None], *args: Any) -> None:
    """fn(*args, grad_outputs) before `node` runs in a backward pass (the handle is not kept: never removed)."""
    node.register_prehook(functools.partial(fn, *args) if args else fn)


# A call's flat arguments read (`_tap_flat`) and a known tree checked (`_Known.hooks_of`): the Python paths, or
# npu_agent/_fasttap.c's once `use_compiled()` found it; the hooks put on nodes: through torch's Python registration,
# or npu_agent/_fasthook.cpp's (the same hooks, called the same way, without a handle)
_scan: Callable[[tuple[Any, ...], dict[str, Any], list[Any]], _Tapped | None] = _scan_py
_hooks_of: Callable[[_Tree, Any, list[torch.Tensor], list[bool]], _Hooks | None] = _hooks_of_py
_post_hook: Callable[..., None] = _post_hook_py
_pre_hook: Callable[..., None] = _pre_hook_py
_copy: Callable[[torch.Tensor | None], torch.Tensor | None] = _copy_py


def use_compiled() -> None:
    """`_scan` and `_hooks_of` in C from now on where npu_agent/_fasttap.c is built, `_post_hook`, `_pre_hook` and
    `_copy` in C++ where npu_agent/_fasthook.cpp is built for this torch (npu_agent.compiled), else in Python (a
    BackwardTaps calls it when it is made). The C `scan` reads this module's KIND_OF, arg_kind, without_tensors and
    VALUE_KEYS at each call, as `_scan_py` does."""
    global _scan, _hooks_of, _post_hook, _pre_hook, _copy
    from npu_agent.compiled import HOOK, TAP

    module = TAP.load()
    if module is None:
        _scan, _hooks_of = _scan_py, _hooks_of_py
    else:
        module.bind("scan", globals())
        _scan, _hooks_of = module.scan, module.hooks_of
    hooks = HOOK.load()
    if hooks is None:
        _post_hook, _pre_hook, _copy = _post_hook_py, _pre_hook_py, _copy_py
    else:
        _post_hook, _pre_hook, _copy = hooks.post_hook, hooks.pre_hook, hooks.copy_grad


def _direct_edges(fn: Any, alias_nodes: list[tuple[Any, int]], slots: int) -> list[tuple[int, int]] | None:
    """[(edge, slot)] when every input edge of the output's node `fn` is one of the call's aliases, each alias once
    and every tapped slot an alias: the node's gradients are then exactly the aliases' (nothing else lies between
    them and the output). None otherwise."""
    if not alias_nodes or len(alias_nodes) != slots:
        return None
    edges: list[tuple[int, int]] = []
    for i, (node, _) in enumerate(fn.next_functions):
        if node is None:
            continue
        for alias_node, slot in alias_nodes:
            if node is alias_node:
                edges.append((i, slot))
                break
        else:
            return None   # an edge to something else: a cast, an inner node, a tensor that is not tapped
    if len(edges) != slots or len({slot for _, slot in edges}) != slots:
        return None
    return edges


def _snap(values: list[Any]) -> Snapshot:
    return grads_snapshot(values)
