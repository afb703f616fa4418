"""Where replays run: in a capped, replaceable worker process (default) or in the server itself (docs/design.md §6.8).

A replay executes an allowlisted torch API on arguments a client sent. The server validates them first (the
allowlist, sizes, index bounds), but a replay can still crash in native code, allocate far more than its record, or
run for minutes. `ProcessReplayer` runs every replay of one server worker in a long-lived child process
(gpu_server/replay/sandbox_worker.py) with a memory cap (`--replay-memory-mb`: beyond what the child holds when a replay
starts, by RLIMIT_AS on the CPU; the device memory fraction on CUDA) and a time limit per request
(`--replay-timeout-s`). The records travel through shared memory (gpu_server/replay/sandbox_wire.py); the child decodes
them again with the same decoder; it loads the server's extension file (gpu_server/replay/extensions.py) too, so it
replays the same references. When the child dies, or is killed
at its time limit, the request raises `WorkerLost`: the checker reports that call SKIP with the reason, the record is
quarantined in the spool's journal (never replayed at a restart) and the next request starts a new child.

`InlineReplayer` runs the same replays in the calling thread (`--replay-in thread`): no caps, no copies; kept for
trusted records and for measuring what the process costs (bench/server.py).

Both answer with flattened outputs (gpu_server/replay/run.py `flatten_outputs`; backward gradients keep their None
entries), so the checker is the same for both.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any, Callable

import torch

from gpu_server.job import Job
from gpu_server.memcopy import copy_into
from gpu_server.replay import extensions, prestart, shm_folder, spread
from gpu_server.replay.answer_arenas import AnswerMaps
from gpu_server.replay.fork_server import ForkedWorker
from gpu_server.replay.run import (
    KeptForward,
    ReplayError,
    backward_from,
    flatten_outputs,
    run_backward,
    run_forward,
    run_forward_kept,
)
from gpu_server.replay.sandbox_wire import (
    Arena,
    ArenaFull,
    ChannelClosed,
    ChannelTimeout,
    is_arena_name,
    read_leaves,
    receive,
    send,
)

log = logging.getLogger("gpu_server")


def host_memory(unknown: int) -> int:
    """The host's physical memory in bytes (`unknown` where the platform does not say); the server's memory
    defaults are fractions of it."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return unknown


def default_replay_memory() -> int:
    """An eighth of the host's memory, at least 2 GiB: what one replay may use beyond its worker's start-up size."""
    return max(2 << 30, host_memory(16 << 30) // 8)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    mode: str = "process"          # "process" or "thread" (--replay-in)
    timeout_s: float = 120.0       # --replay-timeout-s
    memory: int | None = None      # --replay-memory-mb in bytes (None: default_replay_memory())

    @property
    def memory_bytes(self) -> int:
        return self.memory or default_replay_memory()


class WorkerLost(Exception):
    """The replay worker died or was stopped during this request; str() is the SKIP reason."""


@dataclasses.dataclass
class ForwardRuns:
    bench: list                    # flattened outputs of the bench run
    same: list | None              # of the same-dtype run (None when it failed: `same_error`)
    same_error: str
    kept: Any = None               # the graphs kept for the backward replay (opaque to the caller), or None
    nbytes: int = 0                # what the kept graphs hold


@dataclasses.dataclass
class BackwardRuns:
    bench: list                    # gradients per forward input (None where none)
    same: list | None
    same_error: str


class InlineReplayer:
    """The replays in the calling thread (`--replay-in thread`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.replaced = 0

    def forward(self, job: Job, keep: bool, match: bool) -> ForwardRuns:
        bench, bench_graph = (run_forward_kept(job, self.device, bench=True) if keep
                              else (run_forward(job, self.device, bench=True), None))
        try:
            same, same_graph = (run_forward_kept(job, self.device, bench=False, match_threads=match) if keep
                                else (run_forward(job, self.device, bench=False, match_threads=match), None))
            same_error = ""
        except ReplayError as exc:
            same, same_graph, same_error = None, None, f"same-dtype run failed: {exc}"
        graphs = (bench_graph, same_graph) if bench_graph is not None or same_graph is not None else None
        nbytes = sum(g.nbytes for g in (bench_graph, same_graph) if g is not None)
        return ForwardRuns(flatten_outputs(bench), flatten_outputs(same) if same is not None else None, same_error,
                           graphs, nbytes)

    def _backward_run(self, graph: KeptForward | None, fwd: Job, bwd: Job, bench: bool, match: bool) -> list:
        if graph is not None:
            return backward_from(graph, fwd, bwd, self.device, match_threads=match)
        return run_backward(fwd, bwd, self.device, bench=bench, match_threads=match)

    def backward(self, fwd: Job, bwd: Job, kept: Any, match: bool) -> BackwardRuns:
        gb, gs = kept if kept is not None else (None, None)
        bench = self._backward_run(gb, fwd, bwd, True, match)
        try:
            same, same_error = self._backward_run(gs, fwd, bwd, False, match), ""
        except ReplayError as exc:
            same, same_error = None, f"same-dtype run failed: {exc}"
        return BackwardRuns(list(bench), list(same) if same is not None else None, same_error)

    def forward_members(self, job: Job, match: bool) -> list[list]:
        return spread.forward_members(job, self.device, match)

    def backward_members(self, fwd: Job, bwd: Job, match: bool) -> list[list]:
        return spread.backward_members(fwd, bwd, self.device, match)

    def drop(self, kept: Any) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _Handles:
    generation: int                # the worker process that holds them
    bench: int | None
    same: int | None


class ProcessReplayer:
    """The replays of one server worker in a child process; one request at a time (the worker thread's)."""

    def __init__(self, device: torch.device, limits: SandboxLimits, threads: int, max_record_bytes: int,
                 name: str = "replay"):
        self.device = device
        self.limits = limits
        self.threads = threads
        self.max_record_bytes = max_record_bytes
        self.name = name
        parent = shm_folder.shm_parent()
        shm_folder.sweep_once(parent)   # the folders of servers killed before they could remove theirs
        self._owned = shm_folder.OwnedFolder(parent)
        self.folder = self._owned.path
        self.inbox = Arena(self.folder, "in")
        self.outbox = AnswerMaps(self.folder, "out")
        self.generation = 0
        self.replaced = 0
        self._proc: subprocess.Popen | ForkedWorker | None = None
        self._w = self._r = -1
        self._drops: list[int] = []
        self._hello = False
        self._how = ""   # started ahead, or forked (gpu_server/replay/prestart.py), or started when it was needed
        self._lock = threading.Lock()
        self._closed = False
        self._spawn()

    # -- the child ---------------------------------------------------------------------------------------------
    def _spawn(self) -> None:
        """A worker interpreter (one gpu-server started ahead, else a new one: gpu_server/replay/prestart.py), told
        what to be by its first message."""
        self._clear_answers()
        child = prestart.take() or prestart.launch()
        self._how = child.how
        args = ["--folder", self.folder, "--device", str(self.device), "--threads", str(self.threads),
                "--memory", str(self.limits.memory_bytes), "--max-record-bytes", str(self.max_record_bytes)]
        ext = extensions.active()
        if ext is not None:   # the child loads the same references (and refuses to start on a changed, bad file)
            args += ["--extensions", ext.path, "--python-path", os.pathsep.join(ext.python_path)]
        self._proc, self._w, self._r = child.proc, child.to_child, child.from_child
        try:
            send(self._w, {"args": args})
        except (ChannelClosed, OSError):
            pass   # it is gone: `ready` says so
        self.generation += 1
        self._drops.clear()
        self._hello = False

    def _clear_answers(self) -> None:
        """Remove the answer arenas a worker left when it was killed (the time limit, a native crash): the next one
        names its arenas from out-0 again, and makes each anew (sandbox_wire.Arena: O_EXCL)."""
        self.outbox.close()
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            if is_arena_name(name, "out"):
                try:
                    os.unlink(os.path.join(self.folder, name))
                except OSError as exc:
                    log.warning("%s: cannot remove %s left by a stopped worker (%s)", self.name, name, exc)

    def ready(self) -> None:
        """Wait for the child started last to be ready (it imports torch); RuntimeError when it does not start."""
        if self._hello:
            return
        try:
            hello = receive(self._r, prestart.START_TIMEOUT_S)
        except (ChannelClosed, ChannelTimeout) as exc:
            how = self._kill()
            raise RuntimeError(f"the replay worker process did not start ({how}; {type(exc).__name__}: {exc}); see "
                               "the lines above") from None
        log.info("%s worker process %s started%s (pid %s, device %s, memory cap %d MiB, time limit %g s)", self.name,
                 self.generation, f" ({self._how})" if self._how else "", hello.get("ready"), self.device,
                 self.limits.memory_bytes >> 20, self.limits.timeout_s)
        self._hello = True

    def _alive(self) -> bool:
        """The child started last is still running (whether its replays are still wanted is `_request`'s)."""
        return self._proc is not None and self._proc.poll() is None

    def _kill(self) -> str:
        """Stop the child for good; returns how it ended ("signal SIGSEGV", "exit status 1")."""
        proc, self._proc = self._proc, None
        for fd in (self._w, self._r):
            if fd >= 0:
                os.close(fd)
        self._w = self._r = -1
        if proc is None:
            return "not running"
        if proc.poll() is None:
            proc.kill()
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return "did not stop"
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit status {code}"

    # -- one request -------------------------------------------------------------------------------------------
    def _ref(self, job: Job, parts: list[bytes | memoryview]) -> dict:
        if job.wire is None:
            raise ReplayError("internal: this job carries no record to replay")
        record, payload, raw = job.wire
        header = raw if raw is not None else record.SerializeToString()
        parts.extend((header, payload))
        return {"record": len(parts) - 2, "payload": len(parts) - 1}

    def _request(self, op: str, jobs: dict[str, Job | None], **fields: Any) -> dict:
        with self._lock:
            if self._closed:
                raise WorkerLost("the server is stopping")
            if self._proc is not None and self._hello and not self._alive():
                # it ended after its last answer (killed, or a crash a replay left behind): not by this request
                how = self._kill()
                log.warning("%s: worker process %d ended between two requests (%s); starting another (the forward "
                            "graphs it kept are gone: their backward records replay their forward again)", self.name,
                            self.generation, how)
            for attempt in (1, 2):   # a start that fails is tried once more, then this request is lost
                if self._proc is None:
                    self.replaced += 1
                    self._spawn()
                try:
                    self.ready()
                    break
                except RuntimeError as exc:   # the next request tries a new one
                    if attempt == 2:
                        raise WorkerLost(f"not replayed: {exc}") from None
                    log.warning("%s: %s; starting another", self.name, exc)
            parts: list[bytes | memoryview] = []
            refs = {k: (self._ref(j, parts) if j is not None else None) for k, j in jobs.items()}
            try:
                view = self.inbox.reserve(sum(len(p) for p in parts))
            except ArenaFull as exc:   # no room for the record in the arenas' folder: this call is SKIP
                raise ReplayError(f"not replayed: {exc}") from None
            spans, off = [], 0
            for p in parts:
                n = copy_into(view, off, p)   # a record's payload without the interpreter lock (gpu_server/memcopy.py)
                spans.append([off, n])
                off += n
            del view
            req = {"op": op, "arena": self.inbox.name, "drop": self._drops[:], "free": self.outbox.take_free(),
                   **fields}
            for k, r in refs.items():
                req[k] = None if r is None else {"record": spans[r["record"]], "payload": spans[r["payload"]]}
            self._drops.clear()
            since = time.monotonic()
            try:
                send(self._w, req)
                reply = receive(self._r, self.limits.timeout_s)
            except ChannelTimeout:
                how = self._kill()
                raise WorkerLost(f"not replayable within --replay-timeout-s {self.limits.timeout_s:g}: the replay was "
                                 f"stopped after {time.monotonic() - since:.0f} s (its worker process {how}, then "
                                 "replaced); the record is quarantined; raise --replay-timeout-s if such calls are "
                                 "legitimate") from None
            except (ChannelClosed, OSError) as exc:
                how = self._kill()
                raise WorkerLost(f"the replay killed its worker process ({how}: a native crash or the memory cap, "
                                 f"--replay-memory-mb {self.limits.memory_bytes >> 20}); the record is quarantined "
                                 f"(never replayed again) and the worker replaced ({exc})") from None
            if "replay_error" in reply:
                raise ReplayError(str(reply["replay_error"])[:2000])
            if "internal_error" in reply:
                raise RuntimeError(f"in the replay worker: {str(reply['internal_error'])[:500]}")
            if "runs" in reply:
                try:
                    reply["runs"] = self._read_answer(reply)
                except (ChannelClosed, OSError) as exc:
                    how = self._kill()
                    raise WorkerLost(f"the replay worker answered what it should not ({exc}); it was stopped ({how}) "
                                     "and replaced; the record is quarantined") from None
            return reply

    def _read_answer(self, reply: dict) -> list[list]:
        """The answer's runs: its tensors views of the worker's arena while the server holds few of them, else
        copies (gpu_server/replay/answer_arenas.py)."""
        self.outbox.forget(reply.get("gone"))
        name = reply.get("arena", "")
        arena, in_place = self.outbox.open(name)
        try:
            return read_leaves(reply["runs"], arena, self.device, copy=not in_place)
        finally:
            del arena
            if not in_place:
                self.outbox.done(name)

    def _handles(self, reply: dict) -> _Handles | None:
        kept = reply.get("kept") or [None, None]
        hb, hs = (h if isinstance(h, int) and not isinstance(h, bool) else None for h in kept[:2])
        return _Handles(self.generation, hb, hs) if hb is not None or hs is not None else None

    # -- the replayer ------------------------------------------------------------------------------------------
    def forward(self, job: Job, keep: bool, match: bool) -> ForwardRuns:
        reply = self._request("forward", {"job": job}, keep=keep, match=match)
        runs = reply["runs"]
        nbytes = reply.get("nbytes", 0)
        return ForwardRuns(runs[0], runs[1] if len(runs) > 1 else None, str(reply.get("same_error", ""))[:2000],
                           self._handles(reply), nbytes if isinstance(nbytes, int) and nbytes >= 0 else 0)

    def backward(self, fwd: Job, bwd: Job, kept: Any, match: bool) -> BackwardRuns:
        # graphs kept by the process a request now goes to: none when the one that kept them died since (the next
        # request starts another, `_request`): the forward is then replayed again, with the same rows
        live = kept if isinstance(kept, _Handles) and kept.generation == self.generation and self._alive() else None
        handles = [live.bench, live.same] if live is not None else None
        # a kept graph holds its forward record in the worker; both graphs are needed to leave the forward out
        need_fwd = live is None or live.bench is None or live.same is None
        reply = self._request("backward", {"fwd": fwd if need_fwd else None, "bwd": bwd}, kept=handles, match=match)
        runs = reply["runs"]
        return BackwardRuns(runs[0], runs[1] if len(runs) > 1 else None, str(reply.get("same_error", ""))[:2000])

    def _members(self, op: str, jobs: dict[str, Job | None], match: bool) -> list[list]:
        try:
            return list(self._request(op, jobs, match=match)["runs"])
        except ReplayError:
            return []
        except WorkerLost as exc:   # the call's own runs were done: it is judged without a spread
            log.warning("the spread runs of %s were not run: %s", next(j.name for j in jobs.values() if j), exc)
            return []

    def forward_members(self, job: Job, match: bool) -> list[list]:
        return self._members("spread_forward", {"job": job}, match)

    def backward_members(self, fwd: Job, bwd: Job, match: bool) -> list[list]:
        return self._members("spread_backward", {"fwd": fwd, "bwd": bwd}, match)

    def drop(self, kept: Any) -> None:
        """Free kept graphs (told to the worker with the next request)."""
        if isinstance(kept, _Handles) and kept.generation == self.generation:
            self._drops.extend(h for h in (kept.bench, kept.same) if h is not None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._proc is not None:
                try:
                    send(self._w, {"op": "exit"})
                    self._proc.wait(timeout=10)
                except (ChannelClosed, OSError, subprocess.TimeoutExpired):
                    pass
                self._kill()
            self.inbox.close()
            self.outbox.close()
            self._owned.close()


Replayer = InlineReplayer | ProcessReplayer


def make_replayer(device: torch.device, limits: SandboxLimits, threads: int, max_record_bytes: int,
                  name: str) -> Replayer:
    if limits.mode == "thread":
        return InlineReplayer(device)
    return ProcessReplayer(device, limits, threads, max_record_bytes, name)


OnLost = Callable[[Job, str], None]
