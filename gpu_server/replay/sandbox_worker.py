"""A replay worker process: runs the replays of one server worker, inside its caps (docs/design.md §6.8).

    python -m gpu_server.replay.sandbox_worker --folder F --rfd R --wfd W --device cpu --threads N --memory BYTES
                                        --max-record-bytes B [--extensions FILE --python-path P]

It decodes each record again from the bytes the server put in its arena (gpu_server/replay/sandbox_wire.py), with the
same decoder the server validated it with, runs the replay functions of gpu_server/replay/run.py and
gpu_server/replay/spread.py
and answers with the outputs. It keeps the autograd graphs of forward replays whose backward record will come, under
handles the server names in its backward request.

The caps: on the CPU, before each request the soft RLIMIT_AS is set to the process's size at that moment (which
holds the kept graphs) plus `--memory`: an allocation past it fails inside the replay, which becomes that call's
SKIP row. On CUDA, the device memory fraction. The server stops a replay that runs past its time limit by killing
this process. A native crash kills only this process.

With `--extensions`, the server's extension file is loaded as the server loaded it (gpu_server/replay/extensions.py; the
folders its modules came from in `--python-path`), before the worker says it is ready; a file that no longer
validates stops the worker with the same message (exit status 2).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import gc
import os
import resource
import signal
import sys
import warnings
from typing import Any, Iterator

import torch

from gpu_server import malloc_policy
from gpu_server.decode import decode_job
from gpu_server.job import Job
from gpu_server.replay import fork_server, spread
from gpu_server.replay import run as replay
from gpu_server.replay.answer_arenas import AnswerArenas
from gpu_server.replay.run import KeptForward, ReplayError, flatten_outputs
from gpu_server.replay.sandbox_wire import (
    ArenaFull,
    ChannelClosed,
    Mapped,
    NotTransferable,
    receive,
    send,
    write_leaves,
)
from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS
from protos.trees import iter_leaves

SLACK = 32 << 20    # address space beyond the cap for what a replay maps besides its tensors (the arenas' growth,
                    # a thread the allocator or the intra-op pool adds later)


def _address_space() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def memory_message(exc: BaseException, cap: int) -> str | None:
    """The SKIP reason for a replay that ran out of this worker's memory cap; None for other failures."""
    text = str(exc)
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM) or \
            "can't allocate memory" in text or "out of memory" in text.lower():
        return (f"not replayable within --replay-memory-mb {cap / (1 << 20):g}: the replay needs more memory than "
                f"one replay worker may use ({text[:200]}); raise --replay-memory-mb if such calls are legitimate")
    return None


class Worker:
    def __init__(self, ns: argparse.Namespace):
        self.device = torch.device(ns.device)
        self.cap = ns.memory
        self.rfd, self.wfd = ns.rfd, ns.wfd
        self.limits = DEFAULT_LIMITS.replace(max_record_bytes=max(ns.max_record_bytes, DEFAULT_LIMITS.max_record_bytes))
        self.inbox = Mapped(ns.folder, "in")
        self.outbox = AnswerArenas(ns.folder, "out")
        self.kept: dict[int, tuple[KeptForward, Job]] = {}
        self.next_handle = 1

    # -- requests ----------------------------------------------------------------------------------------------
    def job(self, ref: Any, arena: memoryview, own: bool = False) -> Job:
        """The job a request names. Its tensors are views of the server's arena, valid until the next request,
        unless `own` (a forward whose graph is kept: its inputs must outlive the request)."""
        (ro, rn), (po, pn) = ref["record"], ref["payload"]
        for off, n in ((ro, rn), (po, pn)):
            if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and 0 <= n and off + n <= len(arena)):
                raise ChannelClosed("a record reference outside the arena")
        raw = bytes(arena[ro:ro + rn])
        record = pb.Record.FromString(raw)
        return decode_job(record, bytearray(arena[po:po + pn]) if own else arena[po:po + pn], self.limits, raw=raw)

    def keep(self, graph: KeptForward | None, job: Job) -> int | None:
        if graph is None:
            return None
        h = self.next_handle
        self.next_handle += 1
        self.kept[h] = (graph, job)
        return h

    def forward(self, req: dict, arena: memoryview) -> dict:
        keep, match = bool(req["keep"]), bool(req["match"])
        job = self.job(req["job"], arena)
        if not keep:
            runs = self._forward_runs(job, False, match)
        else:
            # a kept graph outlives the request, the arena's bytes do not: the replay reads private copies of the
            # inputs, and whatever autograd saves from the record itself (none of the replay paths does) makes the
            # call replay again from a private copy of the record
            with _saved_from(arena) as saved:
                runs = self._forward_runs(job, True, match)
            if saved or _in_arena(arena, runs[0], runs[2], *(list(g.leaves.values()) for g in (runs[1], runs[3]) if g)):
                job = self.job(req["job"], arena, own=True)
                runs = self._forward_runs(job, True, match)
            else:   # the kept graphs need the call's name and thread count, not its tensors (views of the arena)
                job = _without_tensors(job)
        bench, bench_graph, same, same_graph, same_error = runs
        out = [flatten_outputs(bench)] + ([flatten_outputs(same)] if same is not None else [])
        handles = [self.keep(bench_graph, job), self.keep(same_graph, job)]
        nbytes = sum(g.nbytes for g in (bench_graph, same_graph) if g is not None)
        return {"runs": out, "same_error": same_error, "kept": handles, "nbytes": nbytes}

    def _release_outputs(self, handles: list[int | None]) -> int:
        """`replay.release_outputs` on the graphs kept under `handles`; what they hold now."""
        nbytes = 0
        for h in handles:
            kept = self.kept.get(h) if h is not None else None
            if kept is not None:
                try:
                    replay.release_outputs(kept[0])
                except Exception:  # noqa: BLE001 - the graph then keeps its outputs; the answer stands
                    pass
                nbytes += kept[0].nbytes
        return nbytes

    def _forward_runs(self, job: Job, keep: bool, match: bool) -> tuple:
        """(bench output, its kept graph, same-dtype output, its kept graph, why the same-dtype run failed)."""
        if keep:
            bench, bench_graph = replay.run_forward_kept(job, self.device, bench=True)
        else:
            bench, bench_graph = replay.run_forward(job, self.device, bench=True), None
        same_error, same, same_graph = "", None, None
        try:
            if keep:
                same, same_graph = replay.run_forward_kept(job, self.device, bench=False, match_threads=match)
            else:
                same = replay.run_forward(job, self.device, bench=False, match_threads=match)
        except ReplayError as exc:
            same_error = f"same-dtype run failed: {exc}"
        return bench, bench_graph, same, same_graph, same_error

    def _backward_run(self, kept: tuple[KeptForward, Job] | None, fwd: Job | None, bwd: Job, bench: bool,
                      match: bool) -> list:
        if kept is not None:
            return replay.backward_from(kept[0], kept[1], bwd, self.device, match_threads=match)
        if fwd is None:
            raise ChannelClosed("a backward request with neither a kept graph nor the forward record")
        return replay.run_backward(fwd, bwd, self.device, bench=bench, match_threads=match)

    def backward(self, req: dict, arena: memoryview) -> dict:
        bwd, match = self.job(req["bwd"], arena), bool(req["match"])
        fwd = self.job(req["fwd"], arena) if req.get("fwd") else None
        handles = req.get("kept") or (None, None)
        hb, hs = (self.kept.pop(h, None) if isinstance(h, int) else None for h in handles[:2])   # used once
        bench = self._backward_run(hb, fwd, bwd, True, match)
        try:
            same, same_error = self._backward_run(hs, fwd, bwd, False, match), ""
        except ReplayError as exc:
            same, same_error = None, f"same-dtype run failed: {exc}"
        return {"runs": [list(bench)] + ([list(same)] if same is not None else []), "same_error": same_error}

    def spread(self, req: dict, arena: memoryview) -> dict:
        match = bool(req["match"])
        if req["op"] == "spread_forward":
            return {"runs": spread.forward_members(self.job(req["job"], arena), self.device, match)}
        fwd, bwd = self.job(req["fwd"], arena), self.job(req["bwd"], arena)
        return {"runs": spread.backward_members(fwd, bwd, self.device, match)}

    def answer(self, req: dict) -> dict:
        self.outbox.release(req.get("free"))   # arenas of earlier answers the server no longer reads
        for h in req.get("drop") or ():
            self.kept.pop(h, None)
        op = req.get("op")
        if op == "drop":
            return {}
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        if self.device.type == "cpu":   # the record itself is bounded by --max-record-mb, not by the replay's cap
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        arena = self.inbox.view(req["arena"])
        if self.device.type == "cpu":   # this replay may map `cap` bytes beyond what the process holds now
            limit = _address_space() + self.cap + SLACK
            resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard),
                                                    hard))
        try:
            if op == "forward":
                body = self.forward(req, arena)
            elif op == "backward":
                body = self.backward(req, arena)
            elif op in ("spread_forward", "spread_backward"):
                body = self.spread(req, arena)
            else:
                raise ChannelClosed(f"unknown request {str(op)[:20]!r}")
            body["runs"], body["arena"] = write_leaves(body["runs"], self.outbox)
            if op == "forward":   # the outputs are copied out: the kept graphs keep only what their backward reads
                body["nbytes"] = self._release_outputs(body["kept"])
            self.outbox.given(body["arena"])
            body["gone"] = self.outbox.take_gone()
            return body
        except ReplayError as exc:
            return {"replay_error": memory_message(exc, self.cap) or str(exc)}
        except NotTransferable as exc:
            return {"replay_error": f"not replayable here: {exc} has no comparable form"}
        except ArenaFull as exc:   # no room for the answer in the arenas' folder: this call is SKIP, nothing else
            return {"replay_error": str(exc)}
        except (MemoryError, RuntimeError, OSError) as exc:   # OSError: an arena that cannot grow (ENOMEM)
            why = memory_message(exc, self.cap)
            if why is None:
                raise
            return {"replay_error": why}

    def serve(self) -> None:
        send(self.wfd, {"ready": os.getpid()})
        while True:
            try:
                req = receive(self.rfd)
            except ChannelClosed:
                return
            if req.get("op") == "exit":
                return
            try:
                reply = self.answer(req)
            except ChannelClosed:
                raise
            except Exception as exc:  # noqa: BLE001 - an internal error costs this request, never the worker
                reply = {"internal_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            send(self.wfd, reply)


def _arena_range(arena: memoryview) -> tuple[int, int]:
    if not len(arena):
        return 0, 0
    start = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
    return start, start + len(arena)


def _over(t: torch.Tensor, lo: int, hi: int) -> bool:
    """`t`'s memory lies in [lo, hi) (a tensor whose memory cannot be read is taken to)."""
    try:
        return lo <= t.untyped_storage().data_ptr() < hi
    except Exception:  # noqa: BLE001 - no storage to ask (a subclass, a sparse layout): assume the worst
        return True


@contextlib.contextmanager
def _saved_from(arena: memoryview) -> Iterator[list]:
    """Within this block, autograd saving a tensor over `arena`'s memory for a backward is noted in the list."""
    lo, hi = _arena_range(arena)
    seen: list[bool] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _over(t, lo, hi):
            seen.append(True)
        # the same memory, without its autograd history: the tensor itself would hold an output's grad_fn, which
        # holds what was saved, a reference cycle that keeps the graph alive until a garbage collection
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def _in_arena(arena: memoryview, *values: Any) -> bool:
    """Some tensor in `values` (nested) lies over `arena`'s memory."""
    lo, hi = _arena_range(arena)
    return any(isinstance(t, torch.Tensor) and _over(t, lo, hi) for t in iter_leaves(values))


def _without_tensors(job: Job) -> Job:
    """The job a kept graph needs for its backward (gpu_server/replay/run.py `backward_from`: its name, category and
    thread count), holding nothing of the request's arena."""
    return dataclasses.replace(job, args=(), kwargs={}, output=None, grad_output=None, grad_input=None, mask=None,
                               requires_grad=frozenset(), rng_state=b"", wire=None)


def _warm_up_any_device() -> None:
    """What a first replay would load lazily, loaded before the worker knows its arguments (its time limit counts
    from each request): the meta registrations and the Python references that meta kernels route through (they
    import torch._dynamo: seconds)."""
    replay.warm_up()
    try:
        torch.relu(torch.empty(2, device="meta"))
    except Exception:  # noqa: BLE001 - only a warm-up
        pass


_PR_SET_PDEATHSIG = 1


def _die_with_the_server() -> None:
    """Linux: SIGKILL for this process when the server ends, however it ends (kill -9 included). The server stops a
    replay past its time limit; once it is gone nothing else would stop one (this process ignores SIGTERM and has a
    session of its own), and it would run to its end, or forever. Its pipe closing stops only a process that waits
    for a request. Elsewhere, or when prctl is not there, nothing changes."""
    parent = os.getppid()
    if not fork_server.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL)):
        return
    if os.getppid() != parent:   # the server ended before the line above: no signal will come
        os._exit(0)


def _warm_up_threads() -> None:
    """The intra-op pool's threads, once their number is set (their stacks are address space, measured before the
    cap is set)."""
    a = torch.ones(256, 256)
    (a @ a).sum()


def _arguments(argv: list[str]) -> list[str] | None:
    """The worker's arguments: its pipes from the command line (gpu_server/replay/prestart.py launched it), the rest
    from the first message on its pipe, which may come long after the start. None when the server is gone first."""
    fds = argparse.ArgumentParser(prog="gpu_server.replay.sandbox_worker", add_help=False)
    fds.add_argument("--rfd", type=int, required=True)
    fds.add_argument("--wfd", type=int, required=True)
    known = fds.parse_args(argv)
    _warm_up_any_device()   # while the server imports torch itself
    try:
        message = receive(known.rfd)
    except ChannelClosed:
        return None
    args = message.get("args")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        print("gpu-server replay worker: its first message did not hold its arguments", file=sys.stderr)
        return None
    return argv + args


def main(argv: list[str] | None = None) -> int:
    # The server ends this process (its exit message, its pipe closing, a kill at the time limit). SIGINT and SIGTERM
    # sent to every process of a cgroup (systemd's default KillMode) while the server drains must not end the replay
    # it waits for: that record would be quarantined as a crash and the next backward sent to a replacement
    # (gpu_server/replay/prestart.py starts this process in a session of its own against the process group's).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_the_server()
    fork_server.name_this_process(fork_server.WORKER_NAME)   # forked or not, `ps` shows it as a replay worker
    malloc_policy.keep_freed_memory()   # each record's tensors take the pages the last one freed
    argv = _arguments(sys.argv[1:] if argv is None else list(argv))
    if argv is None:
        return 0
    p = argparse.ArgumentParser(prog="gpu_server.replay.sandbox_worker")
    p.add_argument("--folder", required=True)
    p.add_argument("--rfd", type=int, required=True)
    p.add_argument("--wfd", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--memory", type=int, required=True)
    p.add_argument("--max-record-bytes", type=int, default=0)
    p.add_argument("--extensions", default=None)
    p.add_argument("--python-path", default="")
    ns = p.parse_args(argv)
    if ns.extensions:
        from gpu_server.replay import extensions

        try:
            extensions.load(ns.extensions, [f for f in ns.python_path.split(os.pathsep) if f])
        except extensions.ExtensionError as exc:
            print(f"gpu-server replay worker: {exc}", file=sys.stderr)
            return 2
    # records are decoded as read-only views of the server's arena: the replay never writes its inputs in place (it
    # replays on private copies), and a write would fault here instead of changing what the server holds
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    torch.set_grad_enabled(False)
    if ns.threads > 0:
        torch.set_num_threads(ns.threads)
    _warm_up_threads()   # (the warm-up that needs no device ran while the arguments were awaited: `_arguments`)
    # what start-up made (torch's modules, the warm-up) lives as long as the process: out of the collector's reach,
    # a full collection no longer walks it again and again while records are replayed
    gc.freeze()
    worker = Worker(ns)
    if worker.device.type == "cuda":
        total = torch.cuda.get_device_properties(worker.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, ns.memory / total), worker.device)
    try:
        worker.serve()
    finally:
        worker.outbox.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
