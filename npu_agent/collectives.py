"""torch.distributed collectives as records the server checks across ranks (issue 22).

A collective of `protos.apis.COLLECTIVES` (and the point-to-point calls of `POINT_TO_POINT`) is recorded as
`Distributed.<api>.N` with a `CollectiveCall`: the training (`job`), the process group (`group`, `ranks`), this
call's place among the group's collectives (`seq`), the reduce op, the root. Every rank of the group produces the same
(job, group, ranks, seq) for the same collective, with no communication of ours:

- `job`: a hash of what every rank of one training shares at hand (the default store's address, the elastic run id,
  the world size; the host name when the address is loopback), computed once;
- `group`, `ranks`: the process group's name and its members (global ranks, group-rank order), cached per group;
- `seq`: the collectives this rank called on the group while the capture mode was on, counted before any selection
  (api list, scope, sampling, rank filter), so a call sampled out still counts; p2p: the messages source ->
  destination so far.

Inputs are copied before the call (the call writes its buffers), the output is taken after it; an `async_op=True`
call's output when the training waits on its Work (`Work.wait`, patched once on the class by `install()`), or the
record goes out `unfinished` at the step boundary / capture stop. A call that raises goes out with `error` and
`unfinished`, then the exception reaches the training unchanged.

Functional collectives: in torch 2.13 the mode sees `torch.ops._c10d_functional.<op>` (what
`torch.distributed._functional_collectives.all_reduce` and kin call) and `torch.ops._c10d_functional.wait_tensor`
when the training calls it itself. The wait an `AsyncCollectiveTensor` issues at its first use runs inside its
`__torch_dispatch__`, where the mode is not active: `install()` wraps the module function
`_functional_collectives.wait_tensor` it calls, so that wait is seen too. The output is taken at the wait.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import socket
import threading
from typing import Any, Callable

import torch

from npu_agent.records import CollectiveCall, PendingRecord
from npu_agent.snapshot import snapshot
from protos import apis
from protos.torch_compat import op_overload_name

log = logging.getLogger("npu_agent")

# torch.distributed's functions that reach the mode under another name than the API the server knows
ALIASES = {"all_gather_single": "all_gather_into_tensor", "_all_gather_base": "all_gather_into_tensor",
           "reduce_scatter_single": "reduce_scatter_tensor", "_reduce_scatter_base": "reduce_scatter_tensor"}
# torch.ops._c10d_functional operators captured (naming.py classifies them as Distributed); wait_tensor takes outputs
FUNCTIONAL = frozenset({"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                        "broadcast"})
WAIT = "wait_tensor"
CAPTURED = apis.COLLECTIVES | apis.POINT_TO_POINT
MAX_PENDING = 256          # async records waiting for their wait(); the oldest go out unfinished beyond it
NOT_CHECKED = "is not checked across ranks (only {} and send/recv are)".format(", ".join(sorted(apis.COLLECTIVES)))


def not_checked_reason(api: str) -> str:
    return f"torch.distributed.{api} {NOT_CHECKED}"


@dataclasses.dataclass(slots=True)
class Plan:
    """What one collective call is recorded as, worked out before it runs."""

    api: str
    call: CollectiveCall | None            # None: a receive whose source only the call tells
    inputs: tuple[tuple[Any, ...], dict[str, Any]]
    output: Any = None                     # the buffers holding the output after the call (None: no output)
    has_output: bool = True
    site: tuple[str, str, str] = ("", "", "")   # the sampling call site: (api, group, op); p2p: ("p2p", pair, "")
    skip: str = ""
    functional: bool = False               # a _c10d_functional op: the output is the result, taken at wait_tensor
    peer_known: bool = True


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    if i < len(args):
        return args[i]
    return kwargs.get(name, default)


def reduce_op_name(op: Any) -> str | None:
    """The lower-case name of a ReduceOp (or a functional collective's op string), None when not a checked one."""
    if isinstance(op, str):
        name = op.lower()
    else:
        inner = getattr(op, "op", None)   # a ReduceOp instance wraps a RedOpType (PREMUL_SUM carries a factor)
        red = inner if inner is not None and not isinstance(op, type(inner)) else op
        name = str(getattr(red, "name", "")).lower()
    return name if name in apis.REDUCE_OPS else None


def _store_address() -> str:
    """What identifies the default group's rendezvous store, read from the store object (no access to it)."""
    import torch.distributed.distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
    except Exception:  # noqa: BLE001 - not initialised or no store
        store = None
    for _ in range(8):   # unwrap PrefixStores
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    if store is not None:
        host, port, path = getattr(store, "host", None), getattr(store, "port", None), getattr(store, "path", None)
        if host is not None and port is not None:
            return f"tcp:{host}:{port}"
        if path:
            return f"file:{path}"
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"tcp:{addr}:{port}" if addr or port else ""


def _loopback(address: str) -> bool:
    host = address.split(":", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("", "localhost", "::1", "0.0.0.0") or host.startswith("127.") or address.startswith("file:")


def job_id(world_size: int) -> str:
    """An id equal on every rank of one training and different between trainings, without any communication:
    16 hex characters of a hash of the store address, TORCHELASTIC_RUN_ID, the world size (and the host name where
    the address is only meaningful on this host)."""
    address = _store_address()
    parts = [address, os.environ.get("TORCHELASTIC_RUN_ID", ""), str(world_size)]
    if _loopback(address):
        parts.append(socket.gethostname())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class _Group:
    __slots__ = ("pg", "name", "ranks", "missing")

    def __init__(self, pg: Any, name: str, ranks: tuple[int, ...], missing: tuple[int, ...]) -> None:
        self.pg, self.name, self.ranks, self.missing = pg, name, ranks, missing


class Collectives:
    """Per-process state: the job, each group's name/ranks and seq counter, the p2p counters, the async calls
    waiting for their wait(). `capturing`: the agent config's ranks (empty: all)."""

    def __init__(self, submit: Callable[[PendingRecord], None], capturing: frozenset[int] = frozenset()) -> None:
        self.submit = submit   # Capturer's submission (counts, then the sink)
        self.capturing = capturing
        self._job: str | None = None
        self._me: int | None = None
        self._groups: dict[int, _Group] = {}
        self._by_name: dict[str, _Group] = {}
        self._seq: collections.Counter[str] = collections.Counter()
        self._p2p: collections.Counter[tuple[int, int]] = collections.Counter()
        self._lock = threading.Lock()

    # -- identity --------------------------------------------------------------------------------------------
    @property
    def job(self) -> str:
        if self._job is None:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1)
            self._job = job_id(world)
        return self._job

    @property
    def me(self) -> int:
        if self._me is None:
            import torch.distributed as dist

            self._me = dist.get_rank()
        return self._me

    def group(self, pg: Any) -> _Group | None:
        """The group's name and members (cached); None when this rank is not in it (the call does nothing)."""
        import torch.distributed.distributed_c10d as c10d

        if isinstance(pg, str):
            hit = self._by_name.get(pg)
            if hit is not None:
                return hit
            pg = c10d._resolve_process_group(pg)  # type: ignore[attr-defined,arg-type]  # a group name
        if pg is None:
            pg = c10d._get_default_group()
        hit = self._groups.get(id(pg))
        if hit is not None and hit.pg is pg:
            return hit
        if pg is c10d.GroupMember.NON_GROUP_MEMBER:
            return None
        try:
            name = c10d._get_process_group_name(pg)
        except Exception:  # noqa: BLE001 - older torch
            name = str(getattr(pg, "group_name", ""))
        ranks = tuple(int(r) for r in c10d.get_process_group_ranks(pg))
        if self.me not in ranks:
            return None
        missing = tuple(r for r in ranks if self.capturing and r not in self.capturing)
        g = self._groups[id(pg)] = self._by_name[name] = _Group(pg, name, ranks, missing)
        return g

    # -- before the call -------------------------------------------------------------------------------------
    def plan(self, func: Any, api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan | None:
        """What the call is recorded as; counts its seq. None: the call is not this rank's (not in the group)."""
        if op_overload_name(func) is not None:
            return self._functional(api, args, kwargs)
        if api in apis.POINT_TO_POINT:
            return self._p2p_plan(api, args, kwargs)
        async_op = bool(kwargs.get("async_op", False))
        pos_group = {"all_gather": 2, "all_gather_into_tensor": 2, "all_to_all": 2}.get(api, 99)
        g = self.group(_arg(args, kwargs, pos_group, "group"))
        if g is None:
            return None
        with self._lock:
            seq = self._seq[g.name]
            self._seq[g.name] = seq + 1
        op = ""
        root = -1
        a0 = _arg(args, kwargs, 0, "tensor")
        raw: Any = None
        if api in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
            raw = _arg(args, kwargs, 1 if api == "all_reduce" else 2, "op")
            op = reduce_op_name("sum" if raw is None else raw) or ""
        if api in ("reduce", "broadcast"):
            key = "dst" if api == "reduce" else "src"
            root = self._global(g, _arg(args, kwargs, 1, key), kwargs.get("group_" + key))
        call = CollectiveCall(self.job, g.name, g.ranks, seq, op, root, async_op)
        site = (api, g.name, op)
        if api in ("all_reduce", "reduce", "broadcast"):
            plan = Plan(api, call, ((a0,), {}), a0, site=site)
        elif api == "all_gather":
            out_list, t = args[0] if args else kwargs["tensor_list"], _arg(args, kwargs, 1, "tensor")
            plan = Plan(api, call, ((t,), {}), list(out_list), site=site)
        elif api in ("all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter"):
            out, inp = _arg(args, kwargs, 0, "output_tensor" if api == "all_gather_into_tensor" else "output"), \
                _arg(args, kwargs, 1, "input_tensor" if api == "all_gather_into_tensor" else
                     ("input_list" if api == "reduce_scatter" else "input"))
            plan = Plan(api, call, ((list(inp) if api == "reduce_scatter" else inp,), {}), out, site=site)
        elif api == "all_to_all":
            out, inp = _arg(args, kwargs, 0, "output_tensor_list"), _arg(args, kwargs, 1, "input_tensor_list")
            plan = Plan(api, call, ((list(inp),), {}), list(out), site=site)
        else:   # all_to_all_single
            out, inp = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input")
            osz, isz = _arg(args, kwargs, 2, "output_split_sizes"), _arg(args, kwargs, 3, "input_split_sizes")
            plan = Plan(api, call, ((inp,), {"output_split_sizes": None if osz is None else list(osz),
                                             "input_split_sizes": None if isz is None else list(isz)}), out, site=site)
        if op == "" and api in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
            plan.skip = (f"torch.distributed.{api} with reduce op {_op_text(raw)} is not checked across ranks "
                         f"(checked: {', '.join(sorted(apis.REDUCE_OPS))})")
        self._missing(plan, g)
        return plan

    def _functional(self, api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan | None:
        """torch.ops._c10d_functional.<api>(input, ..., group_name): out of place, the output is its result."""
        names = {"all_reduce": ("input", "reduce_op", "group_name"),
                 "all_gather_into_tensor": ("input", "group_size", "group_name"),
                 "reduce_scatter_tensor": ("input", "reduce_op", "group_size", "group_name"),
                 "all_to_all_single": ("input", "output_split_sizes", "input_split_sizes", "group_name"),
                 "broadcast": ("input", "src", "group_name")}[api]
        bound = {n: _arg(args, kwargs, i, n) for i, n in enumerate(names)}
        g = self.group(bound["group_name"])
        if g is None:
            return None
        with self._lock:
            seq = self._seq[g.name]
            self._seq[g.name] = seq + 1
        op, root = "", -1
        if "reduce_op" in bound:
            op = reduce_op_name(bound["reduce_op"]) or ""
        if api == "broadcast":
            src = int(bound["src"])
            root = g.ranks[src] if 0 <= src < len(g.ranks) else src   # the op's src is a group rank
        kw: dict[str, Any] = {}
        if api == "all_to_all_single":
            kw = {"output_split_sizes": list(bound["output_split_sizes"] or []) or None,
                  "input_split_sizes": list(bound["input_split_sizes"] or []) or None}
        call = CollectiveCall(self.job, g.name, g.ranks, seq, op, root, True)
        plan = Plan(api, call, ((bound["input"],), kw), None, site=(api, g.name, op), functional=True)
        if "reduce_op" in bound and not op:
            plan.skip = (f"torch.distributed functional {api} with reduce op {bound['reduce_op']!r} is not checked "
                         f"across ranks (checked: {', '.join(sorted(apis.REDUCE_OPS))})")
        self._missing(plan, g)
        return plan

    def _missing(self, plan: Plan, g: _Group) -> None:
        if g.missing and not plan.skip:
            plan.skip = (f"ranks {list(g.missing)} of process group {g.name!r} (ranks {list(g.ranks)}) do not capture "
                         "(the agent config's `rank` list leaves them out): its check across ranks could never "
                         "complete")

    def _global(self, g: _Group, rank: Any, group_rank: Any) -> int:
        if rank is not None:
            return int(rank)
        if group_rank is not None and 0 <= int(group_rank) < len(g.ranks):
            return g.ranks[int(group_rank)]
        return -1

    def _p2p_plan(self, api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan | None:
        send = api in ("send", "isend")
        tensor = _arg(args, kwargs, 0, "tensor")
        key = "dst" if send else "src"
        pg = kwargs.get("group")
        peer: Any = _arg(args, kwargs, 1, key)
        group_peer = kwargs.get("group_" + key)
        if peer is None and group_peer is not None:
            g = self.group(pg)
            if g is None:
                return None
            peer = self._global(g, None, group_peer)
        me = self.me
        async_op = api in ("isend", "irecv")
        if send:
            return self._p2p_message(Plan(api, None, ((tensor,), {}), None, has_output=False), me, int(peer),
                                     async_op)
        plan = Plan(api, None, ((), {}), tensor)
        if peer is None:
            plan.peer_known = False
            if api == "irecv":
                plan.skip = ("torch.distributed.irecv from any source (src=None) is not checked across ranks: the "
                             "source is not known when the record is made")
            return plan
        return self._p2p_message(plan, int(peer), me, async_op)

    def _p2p_message(self, plan: Plan, src: int, dst: int, async_op: bool) -> Plan:
        with self._lock:
            seq = self._p2p[(src, dst)]
            self._p2p[(src, dst)] = seq + 1
        plan.call = CollectiveCall(self.job, "p2p", (src, dst), seq, "", dst if src == self.me else src, async_op)
        plan.site = ("p2p", f"{src}->{dst}", "")
        plan.peer_known = True
        if self.capturing:
            missing = [r for r in (src, dst) if r not in self.capturing]
            if missing:
                plan.skip = (f"rank {missing[0]} does not capture (the agent config's `rank` list leaves it out): "
                             f"the message {src} -> {dst} can never be checked")
        return plan

    def received_from(self, plan: Plan, source: Any) -> None:
        """recv(src=None): the source the call returned gives the message its place."""
        if isinstance(source, int) and source >= 0:
            self._p2p_message(plan, source, self.me, False)
        else:
            plan.skip = "torch.distributed.recv from any source: the call did not tell the source"


def _op_text(op: Any) -> str:
    inner = getattr(op, "op", None)
    return str(getattr(inner, "name", None) or getattr(op, "name", None) or op)


# -- async: outputs at wait ------------------------------------------------------------------------------------
class Pending:
    """Records whose output is taken at a wait: an async c10d call's Work, a functional collective's result tensor.
    Keyed by id(object), holding the object (its id cannot be reused while it waits here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: collections.OrderedDict[int, tuple[Any, PendingRecord, Plan, Collectives]] = \
            collections.OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def park(self, key: Any, rec: PendingRecord, plan: Plan, owner: Collectives) -> None:
        evicted = []
        with self._lock:
            self._waiting[id(key)] = (key, rec, plan, owner)
            while len(self._waiting) > MAX_PENDING:
                evicted.append(self._waiting.popitem(last=False)[1])
        for _, r, _, o in evicted:
            _unfinished(r, o)

    def take(self, key: Any) -> tuple[PendingRecord, Plan, Collectives] | None:
        if not self._waiting:
            return None
        with self._lock:
            hit = self._waiting.get(id(key))
            if hit is None or hit[0] is not key:
                return None
            del self._waiting[id(key)]
        return hit[1], hit[2], hit[3]

    def flush(self, owner: Collectives | None = None) -> int:
        """Records never waited on: out now, unfinished (the step boundary, capture stop, close)."""
        with self._lock:
            keys = [k for k, v in self._waiting.items() if owner is None or v[3] is owner]
            gone = [self._waiting.pop(k) for k in keys]
        for _, rec, _, o in gone:
            _unfinished(rec, o)
        return len(gone)


PENDING = Pending()


def _unfinished(rec: PendingRecord, owner: Collectives, error: str = "") -> None:
    assert rec.collective is not None
    rec.collective.unfinished = True
    rec.collective.error = error
    rec.output = None
    owner.submit(rec)


def finish(rec: PendingRecord, plan: Plan, owner: Collectives, out: Any = None) -> None:
    """The call (or its wait) returned: its output now."""
    if plan.has_output:
        rec.output = snapshot(out if plan.functional else plan.output)
    owner.submit(rec)


def failed(rec: PendingRecord, owner: Collectives, exc: BaseException) -> None:
    _unfinished(rec, owner, str(exc) or type(exc).__name__)


def waited(key: Any, out: Any = None, exc: BaseException | None = None) -> None:
    """A Work or a functional result was waited on: its record's output is taken now (never raises)."""
    try:
        hit = PENDING.take(key)
        if hit is None:
            return
        rec, plan, owner = hit
        if exc is not None:
            failed(rec, owner, exc)
        else:
            finish(rec, plan, owner, out)
    except Exception:  # noqa: BLE001 - never into the training
        log.debug("online check: taking the output of a collective at its wait failed", exc_info=True)


_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Once per process: take async outputs at `Work.wait()` and at the functional collectives' `wait_tensor`."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
        try:
            import torch.distributed as dist

            work_cls = dist.Work
            original = work_cls.wait

            def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
                if not PENDING:
                    return original(self, *args, **kwargs)
                try:
                    result = original(self, *args, **kwargs)
                except BaseException as exc:
                    waited(self, exc=exc)
                    raise
                waited(self)
                return result

            setattr(work_cls, "wait", wait)   # noqa: B010 - the class attribute, once
        except Exception:  # noqa: BLE001 - no torch.distributed: nothing is async
            log.debug("online check: Work.wait could not be wrapped", exc_info=True)
        try:
            import torch.distributed._functional_collectives as fc

            original_wait: Callable[[torch.Tensor], Any] = fc.wait_tensor  # type: ignore[no-untyped-call,unused-ignore]

            def wait_tensor(tensor: torch.Tensor) -> Any:
                out = original_wait(tensor)
                if PENDING:
                    waited(tensor, out)
                return out

            setattr(fc, "wait_tensor", wait_tensor)   # noqa: B010 - AsyncCollectiveTensor's wait calls it by name
        except Exception:  # noqa: BLE001
            log.debug("online check: _functional_collectives.wait_tensor could not be wrapped", exc_info=True)
