"""Training cost of the checker, side by side in one run: off, capture only, and online, on two models.

    python bench/overhead.py [--models tiny,mid] [--rounds 3] [--tiny-steps 20] [--mid-steps 3]
    python bench/overhead.py --per-call [--baseline PATH]
    python bench/overhead.py --agent-alone [--mid-steps 3] [--rounds 3] [--memory-mb 4096] [--folder DIR]
                             [--agent-alone-model mid|tiny]
                             [--baseline PATH]

The agent alone (`--agent-alone`, issue 25 goal 1): the mid transformer, every call checked forward and backward,
the folder transport into a folder no server reads yet (the server would start after the training), so the agent is
measured alone. The training thread keeps one core, the agent's threads (`online-check-*`) are moved to the other.
Per step, off and on alternating round by round: wall time and the training thread's CPU; the MB the agent writes a
step against the MB/s the training makes them at; and the folder's floor: the same files written and published bare
(new file, write, fsync, rename, fsync of the folder) by one thread on the agent's core. And the floor of the
training's own cost ("beside"): off steps while a thread on the agent's core copies the bytes the agent wrote a step
out of memory and publishes them bare, so the training meets the same memory traffic and kernel work without any of
the agent's code; on / beside is what the agent adds above that. Each variant's line gives the training thread's
minor page faults a step too: on a CPU training, the references the agent holds until it wrote them keep the
allocator from reusing that memory, so the training's kernels write into new pages; the agent keeps glibc's freed
memory in the process for that (npu_agent/freed_memory.py), and its thresholds then hold for the off steps of the
same process too. So the training without the checker is measured apart as well ("apart", the goal's reference): off
steps in a child process on the training's core that the agent never ran in, glibc's own thresholds, run between the
rounds while this process waits. `--folder` picks where the folder is made: /dev/shm shows the agent where the disk
is not the limit. After each round the bench removes the round's record files, as the server would have read them
(in /dev/shm they would take the memory: 3 rounds of the mid transformer are about 15 GB).

Per call (`--per-call`, no server; issue 25 goal 2): against its floor, a TorchFunctionMode that does nothing, in
the same process: TinyLM (tiny) steps alternating step by step between off, the no-op mode, the agent's capture mode
with a sampler that skips every call (after one step that met every call site; following modules, as
PrecisionDebugger.start() does) and the capture mode recording every call (records discarded); the
fastest step of the training thread's CPU of each (other work on the machine only adds time), per call above off.
Then the mode's path alone: C-bound calls (F.linear, view, add, transpose) in short loops, the fastest of 300.
`--baseline PATH` also measures the checkout at PATH (e.g. `git worktree add --detach /tmp/base HEAD` of the
previous main; this file's benchmark, that checkout's agent) and prints both, before -> after: each tree in a process
that stays up, the `--per-call-rounds` rounds alternating between them (the order reversed every other round), the
fastest step of each variant kept over all rounds. Runs one after the other read this VM's drift as a change: the
previous main run first, then this checkout, gave 97.7 and 142.7 us a captured call for code about 4 us apart (the
off step went from 3.9 to 6.1 ms between them). Ratios are printed last.

Models: TinyLM (2 layers, d=32, batch 4x16, bfloat16: many small records) and the mid transformer (4 layers,
d=512, 8 heads, seq 128, batch 8, float32: about 55 calls and most of a GB of inputs, outputs and gradients a step).

- "capture only": the real capture mode (names, references, backward taps and hooks, each call's module path and
  source line of npu_agent.location) with a sink that discards the records;
- "no location": the same without the module path and source line (`Capturer(locate=False)`):
  the difference is what locating calls costs, printed per record; the bench also times `location.current()`'s
  work itself on every captured call of one extra capture-only round (module path and source line, us per call);
- "online": the real agent streaming to a real gpu-server subprocess on loopback, forward and backward checked.
  Its cost includes the agent's background work: after each round the bench waits until the server acknowledged
  every record and counts that time and CPU in.

The training process runs on one core (`os.sched_setaffinity`, one torch thread: its sender and gRPC threads
share that core), the server on another core. CPU is the training process's CPU time (all its threads), wall the
elapsed time. The variants run round-robin in one process so that they share the machine's state; per-step numbers
are totals over the rounds divided by the steps. Each variant's line also gives the CPU its garbage collections took
(part of its CPU) and how many were full ones (docs/design.md §5: records in flight make them more frequent).
Ratios are printed last.

Collectives (`--collective-iters`, 0 to leave out): a 2-rank gloo loop (two spawned processes, one core each where
the machine has them) of all_reduce and all_gather on mid-size float32 tensors (`--collective-numel` elements),
timed per collective without the agent and under the capture mode (a sink that discards the records: the inputs'
copy, the group lookup and seq count, the output reference), alternating in the same processes.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def _repo_arg() -> str:
    """`--repo PATH` (what `--baseline` passes): measure the agent of that checkout with this file's benchmark."""
    for i, a in enumerate(sys.argv):
        if a == "--repo" and i + 1 < len(sys.argv):
            return os.path.abspath(sys.argv[i + 1])
        if a.startswith("--repo="):
            return os.path.abspath(a.split("=", 1)[1])
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


REPO = _repo_arg()
sys.path.insert(0, REPO)


ALL_CORES = sorted(os.sched_getaffinity(0))   # before this process pins itself: what --baseline's run gets back


def _pin_training() -> tuple[int | None, int | None]:
    """Pin this process to one core before torch starts threads; return (training core, server core)."""
    cores = ALL_CORES
    if len(cores) < 2:
        return None, None
    os.sched_setaffinity(0, {cores[0]})
    return cores[0], cores[1]


TRAIN_CORE, SERVER_CORE = _pin_training()

import torch  # noqa: E402

torch.set_num_threads(1)

from measuring import MeasuringProcess, in_turn  # noqa: E402  (bench/measuring.py, beside this file)
from torch.overrides import TorchFunctionMode  # noqa: E402

from examples.demo import TinyLM, batches, train_step  # noqa: E402
from npu_agent import PrecisionDebugger, location  # noqa: E402
from npu_agent.backward import BackwardTaps  # noqa: E402
from npu_agent.capture import CaptureMode, Capturer  # noqa: E402
from npu_agent.payload import FRAMES  # noqa: E402
from npu_agent.sampling import Policy, Sampler  # noqa: E402

MODELS = {
    # name: (TinyLM kwargs, batch, dtype)
    "tiny": (dict(vocab=96, d=32, heads=4, layers=2, seq=16), 4, torch.bfloat16),
    "mid": (dict(vocab=512, d=512, heads=8, layers=4, seq=128), 8, torch.float32),
}


class _CaptureOnly:
    """The capture mode alone, as a start/stop/step facade, its records discarded (`taps=False`: forward records
    only, no backward taps)."""

    def __init__(self, locate: bool = True, sampler: Sampler | None = None, taps: bool = True) -> None:
        self.records = 0
        self.locate = locate
        self.cap = Capturer(self._sink, backward=BackwardTaps(self._sink) if taps else None, locate=locate,
                            sampler=sampler)
        self.mode = CaptureMode(self.cap)

    def _sink(self, rec) -> None:
        self.records += 1

    def start(self):
        self.mode.__enter__()
        if self.locate:   # as PrecisionDebugger.start(): the module stack is followed while capture is on
            location.install()

    def stop(self):
        self.mode.__exit__(None, None, None)
        location.uninstall()

    def step(self):
        self.cap.release_regions()
        if self.cap.backward is not None:
            self.cap.backward.end_step()
        self.cap.next_step(self.cap.step + 1)

    def drain(self):
        pass


class _Online:
    """The real agent; `drain()` waits until the server acknowledged everything sent so far."""

    def __init__(self, cfg: str) -> None:
        self.dbg = PrecisionDebugger(config_path=cfg)

    def start(self):
        self.dbg.start()

    def stop(self):
        self.dbg.stop()

    def step(self):
        self.dbg.step()

    def drain(self):
        sender = self.dbg._sender
        while sender is not None and (sender._unacked or sender._queue):
            time.sleep(0.002)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def checking_server(work: str, server_cfg: str, port: int):
    """A real gpu-server on the server core (one torch thread), listening on `port` for the block; then killed (its
    checking backlog is not what these benches measure), and its replay workers' shared-memory folder removed (a
    killed server cannot: gpu_server/replay/shm_folder.py; else it held memory until the next server started)."""
    log = open(os.path.join(work, "server.log"), "w")
    pin = (lambda: os.sched_setaffinity(0, {SERVER_CORE})) if SERVER_CORE is not None else None
    server = subprocess.Popen([sys.executable, "-m", "gpu_server.cli", "--config", server_cfg, "--out",
                               os.path.join(work, "out"), "--quiet"], stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=pin)
    try:
        for _ in range(600):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield server
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=60)
        log.close()
        from gpu_server.replay.shm_folder import shm_parent, sweep
        sweep(shm_parent())


class _GcClock:
    """CPU seconds spent in Python's garbage collector (of the thread that ran each collection) and full
    collections, counted from gc callbacks."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._start
            self.full += info["generation"] == 2


GC = _GcClock()


def _round(model, opt, data, dbg) -> tuple[float, float, float, int]:
    g0, f0 = GC.seconds, GC.full
    c0, w0 = time.process_time(), time.perf_counter()
    for idx, tgt in data:
        train_step(model, opt, idx, tgt, dbg)
    if dbg is not None:
        dbg.drain()
    return time.process_time() - c0, time.perf_counter() - w0, GC.seconds - g0, GC.full - f0


class _TimedLocation:
    """Replaces `npu_agent.location.current` for one round: does its work (module path, then source line from the
    capture mode's frame) and adds up the time it takes."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def __call__(self, depth: int = 1) -> tuple[str, str]:
        frame = sys._getframe(depth)
        t0 = time.perf_counter()
        where = location.module_path(), location.source(frame)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return where


def location_cost(model, opt, data) -> tuple[float, int]:
    """us per captured call that finding its module path and source line takes: a capture-only round timed after
    one that fills the caches (a call site's first call walks and formats once)."""
    timed, real = _TimedLocation(), location.current
    location.current = timed
    try:
        _round(model, opt, data[:1], _CaptureOnly())
        timed.seconds, timed.calls = 0.0, 0
        _round(model, opt, data, _CaptureOnly())
    finally:
        location.current = real
    return timed.seconds / max(timed.calls, 1) * 1e6, timed.calls


def bench_model(name: str, steps: int, rounds: int, agent_cfg: str) -> dict:
    kwargs, batch, dtype = MODELS[name]
    torch.manual_seed(0)
    model = TinyLM(dropout=0.1, **kwargs).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = list(batches(steps, batch=batch, seq=kwargs["seq"], vocab=kwargs["vocab"]))
    _round(model, opt, data[:2], None)  # warm-up: lazy optimizer state, allocator
    capture = _CaptureOnly()
    online = _Online(agent_cfg)
    variants = {"off": None, "capture only": capture, "no location": _CaptureOnly(locate=False), "online": online}
    cpu = dict.fromkeys(variants, 0.0)
    wall = dict.fromkeys(variants, 0.0)
    gcs = dict.fromkeys(variants, 0.0)
    full = dict.fromkeys(variants, 0)
    for _ in range(rounds):
        for vname, dbg in variants.items():
            c, w, g, f = _round(model, opt, data, dbg)
            cpu[vname] += c
            wall[vname] += w
            gcs[vname] += g
            full[vname] += f
    counts = online.dbg.close()
    loc_us, loc_calls = location_cost(model, opt, data)
    n = steps * rounds
    return {"model": name, "dtype": str(dtype).replace("torch.", ""), "steps": n,
            "location_us": loc_us, "location_calls": loc_calls,
            "records_per_step": capture.records / n, "cpu": {k: v / n for k, v in cpu.items()},
            "wall": {k: v / n for k, v in wall.items()}, "gc": {k: v / n for k, v in gcs.items()}, "full_gc": full,
            "counts": counts}


def _collective_rank(rank: int, init_file: str, iters: int, numel: int, out_dir: str) -> None:
    """One gloo rank: time all_reduce / all_gather per call, plain and captured, in alternating blocks."""
    import torch.distributed as dist

    cores = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    seen = [0]
    cap = Capturer(lambda rec: seen.__setitem__(0, seen[0] + 1), locate=False)
    mode = CaptureMode(cap)
    x = torch.randn(numel)
    gathered = [torch.empty(numel) for _ in range(2)]
    times = {("all_reduce", False): 0.0, ("all_reduce", True): 0.0, ("all_gather", False): 0.0,
             ("all_gather", True): 0.0}

    def block(captured: bool) -> None:
        for api in ("all_reduce", "all_gather"):
            dist.barrier()
            t0 = time.perf_counter()
            with mode if captured else contextlib.nullcontext():
                for _ in range(iters):
                    if api == "all_reduce":
                        dist.all_reduce(x)
                    else:
                        dist.all_gather(gathered, x)
            times[(api, captured)] += time.perf_counter() - t0
            cap.next_step(cap.step + 1)

    block(False)   # warm up both paths
    block(True)
    times = dict.fromkeys(times, 0.0)
    for _ in range(3):
        block(False)
        block(True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(out_dir, "collectives.json"), "w") as fh:
            json.dump({f"{k[0]} {'captured' if k[1] else 'plain'}": v / (3 * iters) for k, v in times.items()}
                      | {"records": seen[0]}, fh)


def collective_cost(iters: int, numel: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_collective_rank, args=(os.path.join(tmp, "init"), iters, numel, tmp), nprocs=2,
                           start_method="spawn")
        with open(os.path.join(tmp, "collectives.json")) as fh:
            result: dict[str, float] = json.load(fh)
    return result

# -- the agent alone (issue 25, goal 1): the training thread on one core, the agent's threads on the other ---------
def _agent_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("online-check")]


def _pin_agent_threads() -> list[str]:
    """Move the agent's threads (the sender's; the gRPC client's when there is one) to the server core: the
    training thread keeps the training core to itself. Returns the names of the threads moved."""
    moved = []
    for t in _agent_threads():
        if SERVER_CORE is not None and t.native_id is not None:
            with contextlib.suppress(OSError):   # the thread may have ended meanwhile
                os.sched_setaffinity(t.native_id, {SERVER_CORE})
                moved.append(t.name)
    return moved


def agent_alone(steps: int, rounds: int, memory_mb: int, where: str | None = None, model_name: str = "mid") -> dict:
    """Model `model_name` (the mid transformer by default), every call checked forward and backward, the agent
    writing into a shared folder that no server reads yet (the server would start after the training): per step, the
    wall time, the training thread's CPU (`time.thread_time`) and its page faults, off, beside and on alternating
    round by round, and apart (`_OffApart`) between the rounds. The agent's threads run on the other
    core; the training waits for the agent only where the agent makes it wait (its hooks and copies on the
    training thread, the interpreter lock its threads hold, a full memory budget)."""
    model, opt, data = _training(model_name, steps)
    nfs = tempfile.mkdtemp(prefix="bench-agent-alone-", dir=where)
    cfg = os.path.join(nfs, "agent.json")
    folder = os.path.join(nfs, "records")
    os.makedirs(folder)
    with open(cfg, "w") as fh:
        json.dump({"task": "tensor", "level": "L1", "tensor": {"online_run_ut": True, "nfs_path": folder,
                                                                 "online_memory_mb": memory_mb}}, fh)
    # each measured step of each variant: (wall, training-thread CPU, training-thread minor page faults)
    timed: dict[str, list[tuple[float, float, int]]] = {"off": [], "beside": [], "on": [], "apart": []}
    drain = []
    beside = _BareWriter(os.path.join(nfs, "beside"))
    per_step: list[list[int]] = []   # the files the agent wrote a step in the round before, for `beside`
    written = [0, 0.0, 0.0]   # bytes the agent wrote in the measured rounds, its wall time to write them, its CPU
    sender_cpu = 0.0
    last: list[int] = []   # the sizes of the files the agent wrote in the last round, in their order
    apart = _OffApart(steps, model_name)
    try:
        dbg = PrecisionDebugger(config_path=cfg)
        reused = FRAMES.reused
        moved = _pin_agent_threads()
        for r in range(rounds + 1):   # round 0 of each warms up (the agent's first records, page cache, frames)
            for name, d in (("off", None), ("beside", None), ("on", dbg)):
                if name == "beside" and not per_step:
                    continue
                for i, (idx, tgt) in enumerate(data):
                    if name == "beside":
                        beside.start(per_step[i % len(per_step)])
                    step = _timed_step(model, opt, idx, tgt, d)
                    if r:
                        timed[name].append(step)
                    if name == "beside":
                        beside.finish()
                if d is not None:
                    moved = sorted(set(moved) | set(_pin_agent_threads()))
                    w0 = time.perf_counter()
                    sender = dbg._sender
                    while sender is not None and (sender._unacked or sender._queue):
                        time.sleep(0.002)
                    sizes = _take_files(folder)   # (a folder in memory, /dev/shm, would fill the memory)
                    per_step = [sizes[k::steps] for k in range(steps)]
                    if r:
                        drain.append(time.perf_counter() - w0)
                        written[0] += sum(sizes)
                        written[1] += sum(w for w, _, _ in timed["on"][-steps:]) + drain[-1]
                        written[2] += sender.sender_cpu - sender_cpu
                        last = sizes
                    sender_cpu = sender.sender_cpu
            steps_apart = apart.round()
            if r:
                timed["apart"] += steps_apart
        reused = FRAMES.reused - reused   # (read before close: the counter is the pool's, not cleared)
        counts = dbg.close()
        floor = _write_floor(last, nfs)
    finally:
        apart.close()
        beside.close()
        shutil.rmtree(nfs, ignore_errors=True)
    n = steps * rounds
    wall = {k: [w for w, _, _ in v] for k, v in timed.items() if v}
    cpu = {k: [c for _, c, _ in v] for k, v in timed.items() if v}
    label = "mid transformer (float32)" if model_name == "mid" else f"{model_name} ({MODELS[model_name][2]})"
    return {"model": label, "steps": n, "wall": {k: sum(v) / n for k, v in wall.items()},
            "faults": {k: sum(f for _, _, f in v) / n for k, v in timed.items() if v},
            "cpu": {k: sum(v) / n for k, v in cpu.items()}, "drain": sum(drain) / max(len(drain), 1),
            "fastest wall": {k: min(v) for k, v in wall.items()}, "fastest cpu": {k: min(v) for k, v in cpu.items()},
            "counts": counts, "threads": moved, "bytes per step": written[0] / n,
            "agent MB/s": written[0] / max(written[1], 1e-9) / 1e6, "agent CPU per step": written[2] / n,
            "floor MB/s": floor, "frames reused": reused}


def _training(name: str, steps: int):
    """Model `name` of MODELS, its optimizer and `steps` batches, warmed up (lazy optimizer state, allocator)."""
    kwargs, batch, dtype = MODELS[name]
    torch.manual_seed(0)
    model = TinyLM(dropout=0.1, **kwargs).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = list(batches(steps, batch=batch, seq=kwargs["seq"], vocab=kwargs["vocab"]))
    _round(model, opt, data[:2], None)
    return model, opt, data


def _timed_step(model, opt, idx, tgt, dbg) -> tuple[float, float, int]:
    """One training step's (wall seconds, training-thread CPU seconds, training-thread minor page faults)."""
    f0, c0, w0 = _thread_faults(), time.thread_time(), time.perf_counter()
    train_step(model, opt, idx, tgt, dbg)
    return time.perf_counter() - w0, time.thread_time() - c0, _thread_faults() - f0


class _OffApart:
    """Off in a process the agent never ran in (`--off-apart`, a child on the training's core): the training
    without the checker as its user runs it. The agent fixes glibc's malloc thresholds of its process when it starts
    (npu_agent/freed_memory.py), so the bench's own off steps after its first on round run with them too; this
    child keeps glibc's own. It runs its steps when told, between the parent's rounds, while the parent waits."""

    def __init__(self, steps: int, model_name: str) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--off-apart", "--mid-steps", str(steps),
               "--agent-alone-model", model_name, "--repo", REPO]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=REPO))

    def round(self) -> list[tuple[float, float, int]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the off-apart child ended (exit {self.proc.wait()})")
        return [tuple(x) for x in json.loads(line)]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def serve_off_apart(steps: int, model_name: str) -> None:
    """The child of `_OffApart`: a line on stdin runs the steps, their timings go out as one JSON line."""
    model, opt, data = _training(model_name, steps)
    for _ in sys.stdin:
        print(json.dumps([_timed_step(model, opt, idx, tgt, None) for idx, tgt in data]), flush=True)


def _thread_faults() -> int:
    """This thread's minor page faults so far (Linux; 0 elsewhere): a fault is a page the kernel had to find and
    zero, about 1.5 us on this project's VM, 10-25 us once the process holds more than a few GiB
    (bench/first_touch.py)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/stat") as fh:
            return int(fh.read().rpartition(")")[2].split()[7])
    except (OSError, ValueError, IndexError):
        return 0


def _take_files(folder: str) -> list[int]:
    """The sizes of the record files the agent published in `folder` (every record is acknowledged, so published),
    removing them as a server would have."""
    sizes = []
    for d, _, fs in os.walk(folder):
        for f in fs:
            if f.endswith(".rec") and not f.startswith("."):
                path = os.path.join(d, f)
                sizes.append(os.path.getsize(path))
                os.unlink(path)
    return sizes


class _BareWriter:
    """The floor of goal 1: what the agent's work costs the training when none of it is the agent's own. During an
    off step (no checker), a thread on the agent's core copies the bytes of the files the agent wrote in a step of
    the round before out of memory (as the sender copies tensors into payloads: torch's copy, without the
    interpreter lock) and writes and publishes them bare in the same folder. What the training then loses is the
    machine's (memory traffic, page cache, kernel work), not the interpreter's."""

    def __init__(self, where: str):
        os.makedirs(where)
        self.where = where
        self.src = torch.empty(0, dtype=torch.uint8)
        self.dst = torch.empty(0, dtype=torch.uint8)
        self.thread: threading.Thread | None = None
        self.n = 0
        self.written: list[str] = []
        self.dir_fd = os.open(where, os.O_RDONLY)

    def start(self, sizes: list[int]) -> None:
        biggest = max(sizes, default=0)
        if self.src.numel() < biggest:   # outside the step: allocating is not the copy's cost
            self.src = torch.randint(0, 256, (biggest,), dtype=torch.uint8)
            self.dst = torch.empty(biggest, dtype=torch.uint8)
        self.thread = threading.Thread(target=self._write, args=(sizes,))
        self.thread.start()

    def _write(self, sizes: list[int]) -> None:
        if SERVER_CORE is not None:
            os.sched_setaffinity(0, {SERVER_CORE})
        view = memoryview(self.dst.numpy())
        for size in sizes:
            self.dst[:size].copy_(self.src[:size])
            self.n += 1
            tmp, final = os.path.join(self.where, f".f{self.n}.tmp"), os.path.join(self.where, f"f{self.n}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, view[:size])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            os.fsync(self.dir_fd)
            self.written.append(final)

    def finish(self) -> None:
        """Wait (outside the measured step) for the step's files, then remove them as a server would have."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        while self.written:
            os.unlink(self.written.pop())

    def close(self) -> None:
        self.finish()
        os.close(self.dir_fd)


def _write_floor(sizes: list[int], where: str) -> float:
    """The folder transport's floor, MB/s: files of the sizes the agent wrote in a round, each from one ready buffer
    and published as the agent publishes one (a new file, write, fsync, rename, fsync of the folder), by one thread
    on the agent's core. Writes each size once, at most 2 GB in all."""
    out = os.path.join(where, "floor")
    os.makedirs(out)
    buf = memoryview(os.urandom(1 << 20) * (max(sizes, default=0) // (1 << 20) + 1))
    result = [0.0]

    def run() -> None:
        if SERVER_CORE is not None:
            os.sched_setaffinity(0, {SERVER_CORE})
        dir_fd = os.open(out, os.O_RDONLY)
        total, t0 = 0, time.perf_counter()
        for i, size in enumerate(sizes):
            if total > 2_000_000_000:
                break
            fd = os.open(f"f{i}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            os.write(fd, buf[:size])
            os.fsync(fd)
            os.close(fd)
            os.replace(f"f{i}.tmp", f"f{i}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
            total += size
        result[0] = total / (time.perf_counter() - t0) / 1e6
        os.close(dir_fd)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return result[0]


def print_agent_alone(r: dict) -> None:
    c = r["counts"]
    print(f"the agent alone: {r['model']}, {r['steps']} steps a variant (off, beside and on alternating round by "
          f"round, apart between the rounds), every call checked forward and backward into a folder no server "
          f"reads; training thread on core {TRAIN_CORE}, the agent's threads "
          f"({', '.join(r['threads']) or 'none found'}) on core {SERVER_CORE}")
    print(f"  agent: {c['captured']} captured, {c['acknowledged']} written, {c['dropped']} dropped; after each round "
          f"the agent took {r['drain'] * 1e3:.0f} ms more to write what was left (not counted in the steps)")
    made = r["bytes per step"] / r["wall"]["on"] / 1e6
    print(f"  records: {r['bytes per step'] / 1e6:.0f} MB a step, made at {made:.0f} MB/s by the training; the agent "
          f"wrote {r['agent MB/s']:.0f} MB/s (steps and drain), its sender thread {r['agent CPU per step'] * 1e3:.0f} "
          f"ms CPU a step; " + (f"{r['frames reused']} frames written into the memory of earlier ones (the rest "
                                 f"into fresh memory)" if r.get("frames reused") else
                                 "large records copied straight into their files (no frames in memory)"))
    floor = max(r["floor MB/s"], 1e-9)
    per_cpu = r["bytes per step"] / max(r["agent CPU per step"], 1e-9) / 1e6
    print(f"  the floor (the same files written and published bare, one thread on the agent's core): "
          f"{floor:.0f} MB/s, {r['bytes per step'] / floor / 1e3:.0f} ms a step; the agent writes at "
          f"{r['agent MB/s'] / floor:.2f} of it over the steps and drain (it cannot write faster than the training "
          f"makes records), and {per_cpu:.0f} MB per second of its sender thread's CPU, {per_cpu / floor:.2f} of it")
    if r["agent MB/s"] < made:
        print("  the agent writes slower than the training makes records: a longer run fills the memory budget, "
              "then the training waits")
    for v in ("apart", "off", "beside", "on"):
        if v not in r["wall"]:
            continue
        print(f"  {v:6s} wall {r['wall'][v] * 1e3:9.2f} ms/step (fastest {r['fastest wall'][v] * 1e3:8.2f})   training "
              f"thread CPU {r['cpu'][v] * 1e3:9.2f} ms/step (fastest {r['fastest cpu'][v] * 1e3:8.2f})   page faults "
              f"{r.get('faults', {}).get(v, 0):8.0f}/step")
    print("  (apart: off steps in a process the agent never ran in, on the same core between the rounds, with "
          "glibc's own malloc thresholds: the training without the checker; off: this process, with the thresholds "
          "the agent set at its start (npu_agent/freed_memory.py) after the first round; beside: off steps with the "
          "same bytes copied and published bare on the agent's core meanwhile, the floor: what the training loses "
          "to the machine, not to the agent's code; page faults: the training thread's, new memory its kernels "
          "write into)")
    print("\nratios (on / apart)")
    print(f"  wall per step                {r['wall']['on'] / r['wall']['apart']:6.2f}   goal <= 1.10")
    print(f"  training-thread CPU per step {r['cpu']['on'] / r['cpu']['apart']:6.2f}   goal <= 1.05")
    print(f"  fastest steps: wall {r['fastest wall']['on'] / r['fastest wall']['apart']:.2f}, training-thread CPU "
          f"{r['fastest cpu']['on'] / r['fastest cpu']['apart']:.2f}")
    print(f"  on / off in this process: wall {r['wall']['on'] / r['wall']['off']:.2f}, training-thread CPU "
          f"{r['cpu']['on'] / r['cpu']['off']:.2f}; off / apart (the thresholds alone): wall "
          f"{r['wall']['off'] / r['wall']['apart']:.2f}, training-thread CPU "
          f"{r['cpu']['off'] / r['cpu']['apart']:.2f}")
    if "beside" in r["wall"]:
        print(f"  the floor (beside / off): wall {r['wall']['beside'] / r['wall']['off']:.2f}, training-thread CPU "
              f"{r['cpu']['beside'] / r['cpu']['off']:.2f}; on / beside: wall "
              f"{r['wall']['on'] / r['wall']['beside']:.2f}, training-thread CPU "
              f"{r['cpu']['on'] / r['cpu']['beside']:.2f}")


# -- per call: the agent's cost of a call against a TorchFunctionMode that does nothing (issue 25, goal 2) --------
class _NoOpMode(TorchFunctionMode):
    """The floor: a TorchFunctionMode that only runs the call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _CountingMode(TorchFunctionMode):
    """Counts the calls the mode sees (run once, apart: counting is not part of the floor)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class _ModeOnly:
    """A mode pushed around the forward and backward as the agent's is (start/stop), nothing else."""

    def __init__(self, mode: TorchFunctionMode) -> None:
        self.mode = mode

    def start(self):
        self.mode.__enter__()

    def stop(self):
        self.mode.__exit__(None, None, None)

    def step(self):
        pass

    def drain(self):
        pass


def _skipping() -> _CaptureOnly:
    """The capture mode (following modules, as the debugger does) with a sampler that takes only step 0: after one
    step, every call is one the sampling skips (`online_sample_steps` = 2**30)."""
    return _CaptureOnly(sampler=Sampler(Policy(sample_steps=1 << 30)))


def _loop_calls(mode: TorchFunctionMode | None, x: torch.Tensor, w: torch.Tensor, n: int) -> int:
    """n x 4 calls of C-bound APIs (F.linear, Tensor.view, torch.add, Tensor.transpose): the mode's path alone."""
    t0 = time.perf_counter_ns()
    with mode if mode is not None else contextlib.nullcontext():
        for _ in range(n):
            y = torch.nn.functional.linear(x, w)
            z = y.view(-1, w.shape[0])
            torch.add(z, z)
            y.transpose(0, 1)
    return time.perf_counter_ns() - t0


class PerCall:
    """The per-call measures in this process (issue 25, goal 2): TinyLM (tiny, bfloat16, dropout 0.1) steps, the
    variants alternating step by step: off, a no-op TorchFunctionMode, the agent with sampling skipping every call,
    the agent capturing every call; the training thread's CPU (`time.thread_time`) of each step, and the mode's path
    alone in a loop. `round()` adds one pass over the steps and a share of the loops; `result()` keeps the fastest
    step of each variant so far (the machine's other work, a shared core or its SMT sibling, only ever adds time)."""

    def __init__(self, steps: int) -> None:
        kwargs, batch, dtype = MODELS["tiny"]
        torch.manual_seed(0)
        self.model = TinyLM(dropout=0.1, **kwargs).to(dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.data = list(batches(steps, batch=batch, seq=kwargs["seq"], vocab=kwargs["vocab"]))
        counting = _ModeOnly(_CountingMode())
        self.skip, self.every = _skipping(), _CaptureOnly()
        self.variants = {"off": None, "no-op mode": _ModeOnly(_NoOpMode()), "agent, skipped": self.skip,
                         "agent, captured": self.every}
        for dbg in self.variants.values():   # warm-up; the skipping agent meets every call site once (step 0)
            _round(self.model, self.opt, self.data[:2], dbg)
        _round(self.model, self.opt, self.data[:1], counting)
        self.calls = counting.mode.calls
        self.skipped_apis = 0   # calls the skipping agent's sampler counted in the measured steps
        self.every_captured0, self.every_records0 = self.every.cap.captured, self.every.records
        self.times: dict[str, list[float]] = {v: [] for v in self.variants}
        self.x, self.w = torch.randn(16, 32), torch.randn(32, 32)
        self.loop_modes = {"off": None, "no-op mode": _NoOpMode(), "agent, skipped": self.skip.mode}
        self.best = dict.fromkeys(self.loop_modes, float("inf"))
        self.rounds = 0

    def round(self, loops: int) -> None:
        counts = self.skip.cap.sampler.counts
        calls0, captured0 = counts["calls"], counts["captured"]
        for idx, tgt in self.data:
            for name, dbg in self.variants.items():
                t0 = time.thread_time()
                train_step(self.model, self.opt, idx, tgt, dbg)
                self.times[name].append(time.thread_time() - t0)
        counts = self.skip.cap.sampler.counts
        assert counts["captured"] == captured0, "the skipping agent captured calls in the measured steps"
        self.skipped_apis += counts["calls"] - calls0   # (the loops below are new call sites: captured once)
        skip = self.skip
        skip.start()   # following modules as during a step; no module runs in the loop
        skip.stop()
        for _ in range(loops):
            for name, mode in self.loop_modes.items():
                self.best[name] = min(self.best[name], _loop_calls(mode, self.x, self.w, 25) / 100)   # short: rarely
                if mode is skip.mode:                                                                 # preempted
                    skip.step()
        self.rounds += 1

    def result(self) -> dict:
        n = self.rounds * len(self.data)
        agent = os.path.dirname(os.path.dirname(os.path.abspath(location.__file__)))   # the checkout measured
        return {"repo": agent, "steps": n, "calls": self.calls, "apis": self.skipped_apis / n,
                "captured": (self.every.cap.captured - self.every_captured0) / n,
                "records": (self.every.records - self.every_records0) / n,
                "ms": {k: min(v) * 1e3 for k, v in self.times.items()}, "loop_ns": dict(self.best)}


PER_CALL_LOOPS = 300   # loop iterations of each mode in a whole run: the fastest kept


def per_call_cost(steps: int, rounds: int, loops: int) -> dict:
    """The per-call measures of `rounds` passes over `steps` steps, `loops` loop iterations in all (PerCall)."""
    measure = PerCall(steps)
    for _ in range(rounds):
        measure.round(loops // rounds)
    return measure.result()


def serve_per_call(steps: int, loops: int) -> None:
    """A measuring process of `--per-call --baseline`: PerCall set up once, then one round per line on stdin
    ('round'), each answered with the results so far as a JSON line."""
    measure = PerCall(steps)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "round":
            measure.round(loops)
            print(json.dumps(measure.result()), flush=True)


def per_call_alternating(baseline: str, steps: int, rounds: int, loops: int) -> tuple[dict, dict]:
    """(before, after): the per-call measures of the checkout at `baseline` and of this one, each in a process that
    stays up, the rounds alternating between them (the order reversed every other round): this VM's speed drifts
    10-30 % within minutes, which a run of one after the other reads as a change."""
    argv = ["--per-call-serve", "--per-call-steps", str(steps), "--per-call-loops", str(loops // rounds)]
    procs = {label: MeasuringProcess(__file__, repo, ["--repo", repo, *argv], ALL_CORES)   # (each pins itself)
             for label, repo in (("before", os.path.abspath(baseline)), ("after", REPO))}
    last: dict[str, dict] = {}
    try:
        for proc in procs.values():   # both set up meanwhile (before the rounds: they share one core)
            proc.ready()
        for r in range(rounds):
            for label in in_turn(("before", "after"), r):
                last[label] = json.loads(procs[label].ask("round", "{"))
    finally:
        for proc in procs.values():
            proc.close()
    return last["before"], last["after"]


def per_call_lines(r: dict) -> dict[str, float]:
    """The per-call measures of one run: us a call above off, and the ratios."""
    ms, calls = r["ms"], r["calls"]
    noop = (ms["no-op mode"] - ms["off"]) * 1e3 / calls
    skipped = (ms["agent, skipped"] - ms["off"]) * 1e3 / calls
    captured = (ms["agent, captured"] - ms["off"]) * 1e3
    loop = r["loop_ns"]
    loop_noop = (loop["no-op mode"] - loop["off"]) / 1e3
    loop_skip = (loop["agent, skipped"] - loop["off"]) / 1e3
    return {"no-op mode us/call": noop, "skipped us/call": skipped, "skipped / no-op": skipped / noop,
            "loop no-op us/call": loop_noop, "loop skipped us/call": loop_skip,
            "loop skipped / no-op": loop_skip / loop_noop,
            "captured us/captured call": captured / max(r["captured"], 1),
            "captured us/record": captured / max(r["records"], 1)}


GOALS = {"skipped / no-op": 2.0, "loop skipped / no-op": 2.0, "captured us/captured call": 20.0}


def print_per_call(r: dict, base: dict | None) -> None:
    print(f"per call: TinyLM (tiny, bfloat16), {r['steps']} steps a variant alternating step by step, fastest step of "
          f"the training thread's CPU; {r['calls']} calls a step seen by the mode, {r['apis']:.0f} APIs the "
          f"sampling skipped, {r['captured']:.0f} captured ({r['records']:.0f} records with the backward ones)")
    runs = [("before", base), ("after", r)] if base is not None else [("", r)]
    for label, run in runs:
        head = f" [{label}: {run['repo']}]" if label else ""
        print(f"  ms/step{head}: " + "   ".join(f"{k} {v:.3f}" for k, v in run["ms"].items()))
        print(f"  loop ns/call{head}: " + "   ".join(f"{k} {v:.0f}" for k, v in run["loop_ns"].items()))
    after = per_call_lines(r)
    before = per_call_lines(base) if base is not None else None
    print("\nratios and costs (us a call above off; the floor: a TorchFunctionMode that does nothing)")
    for k, v in after.items():
        goal = f"   goal <= {GOALS[k]:g}" if k in GOALS else ""
        was = f"{before[k]:8.2f} -> " if before is not None else ""
        print(f"  {k:28s} {was}{v:8.2f}{goal}")


def _baseline(path: str, argv: list[str]) -> dict:
    """This benchmark run again (a subprocess) against the checkout at `path`; its results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "baseline.json")
        subprocess.run([sys.executable, os.path.abspath(sys.argv[0]), *argv, "--repo", path, "--json", out],
                       check=True, cwd=path, env=dict(os.environ, PYTHONPATH=path),
                       preexec_fn=lambda: os.sched_setaffinity(0, ALL_CORES))   # it pins itself as this one did
        with open(out) as fh:
            result: dict = json.load(fh)
    return result



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,mid")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny-steps", type=int, default=20)
    p.add_argument("--mid-steps", type=int, default=3)
    p.add_argument("--collective-iters", type=int, default=50)
    p.add_argument("--collective-numel", type=int, default=1 << 18)
    p.add_argument("--per-call", action="store_true",
                   help="only the per-call measures (no server): a call the sampling skips and a captured call "
                        "against a no-op TorchFunctionMode")
    p.add_argument("--per-call-steps", type=int, default=20)
    p.add_argument("--per-call-rounds", type=int, default=5)
    p.add_argument("--per-call-serve", action="store_true", help=argparse.SUPPRESS)   # a --baseline measuring process
    p.add_argument("--per-call-loops", type=int, default=PER_CALL_LOOPS // 5, help=argparse.SUPPRESS)
    p.add_argument("--baseline", metavar="PATH", help="with --per-call or --agent-alone: the same measures of the "
                   "checkout at PATH (a `git worktree add /tmp/base HEAD`), printed before/after; --per-call "
                   "alternates its rounds between the two, --agent-alone runs it first")
    p.add_argument("--agent-alone", action="store_true",
                   help="only the agent alone (goal 1): the mid transformer checked forward and backward into a "
                        "folder no server reads, training thread on one core, the agent's threads on the other")
    p.add_argument("--memory-mb", type=int, default=4096, help="with --agent-alone: tensor.online_memory_mb")
    p.add_argument("--agent-alone-model", choices=("mid", "tiny"), default="mid",
                   help="with --agent-alone: the model (default mid; tiny: a quick check of the bench itself)")
    p.add_argument("--folder", default=None, help="with --agent-alone: where the shared folder is made (default: the "
                   "system's temporary folder; /dev/shm shows the agent where the disk is not the limit)")
    p.add_argument("--off-apart", action="store_true", help=argparse.SUPPRESS)   # --agent-alone's off-apart child
    p.add_argument("--repo", metavar="PATH", help=argparse.SUPPRESS)   # read at import (_repo_arg)
    p.add_argument("--json", metavar="PATH", help=argparse.SUPPRESS)   # --baseline's subprocess: results to PATH
    ns = p.parse_args()
    if ns.off_apart:
        serve_off_apart(ns.mid_steps, ns.agent_alone_model)
        return
    if ns.agent_alone:
        argv = ["--agent-alone", "--mid-steps", str(ns.mid_steps), "--rounds", str(ns.rounds), "--memory-mb",
                str(ns.memory_mb), "--agent-alone-model", ns.agent_alone_model]
        argv += ["--folder", ns.folder] if ns.folder else []
        base = _baseline(ns.baseline, argv) if ns.baseline else None
        r = agent_alone(ns.mid_steps, ns.rounds, ns.memory_mb, ns.folder, ns.agent_alone_model)
        if ns.json:
            with open(ns.json, "w") as fh:
                json.dump(r, fh)
            return
        if base is not None:
            print(f"[before: {ns.baseline}]")
            print_agent_alone(base)
            print("\n[after: this checkout]")
        print_agent_alone(r)
        return
    if ns.per_call_serve:
        serve_per_call(ns.per_call_steps, ns.per_call_loops)
        return
    if ns.per_call:
        if ns.baseline:
            base, r = per_call_alternating(ns.baseline, ns.per_call_steps, ns.per_call_rounds, PER_CALL_LOOPS)
        else:
            base, r = None, per_call_cost(ns.per_call_steps, ns.per_call_rounds, PER_CALL_LOOPS)
        print_per_call(r, base)
        return
    coll = collective_cost(ns.collective_iters, ns.collective_numel) if ns.collective_iters > 0 else None
    work = tempfile.mkdtemp(prefix="bench-overhead-")
    port = _free_port()
    server_cfg, agent_cfg = os.path.join(work, "server.json"), os.path.join(work, "agent.json")
    with open(server_cfg, "w") as fh:
        json.dump({"task": "run_ut", "run_ut": {"host": "127.0.0.1", "port": port, "is_online": True}}, fh)
    with open(agent_cfg, "w") as fh:
        json.dump({"task": "tensor", "level": "L1", "tensor": {"online_run_ut": True, "host": "127.0.0.1",
                                                                 "port": port, "online_memory_mb": 4096}}, fh)
    results = []
    try:
        with checking_server(work, server_cfg, port):
            for name in ns.models.split(","):
                steps = ns.tiny_steps if name == "tiny" else ns.mid_steps
                results.append(bench_model(name, steps, ns.rounds, agent_cfg))
    finally:
        shutil.rmtree(work, ignore_errors=True)   # the server's spool and reports: gigabytes on the mid model
    print(f"training on core {TRAIN_CORE}, server on core {SERVER_CORE}, torch threads {torch.get_num_threads()}")
    for r in results:
        c = r["counts"]
        print(f"\n{r['model']} ({r['dtype']}), {r['steps']} steps a variant, {r['records_per_step']:.0f} records "
              f"a step (forward + backward); online: {c['captured']} captured, {c['acknowledged']} acknowledged, "
              f"{c['dropped']} dropped, {c.get('rejected', 0)} rejected")
        for v in r["cpu"]:
            print(f"  {v:13s} CPU {r['cpu'][v] * 1e3:9.2f} ms/step   wall {r['wall'][v] * 1e3:9.2f} ms/step   "
                  f"of which garbage collection {r['gc'][v] * 1e3:7.2f} ms/step ({r['full_gc'][v]} full)")
    print("\nratios (of off; per record: extra training CPU per record)")
    for r in results:
        base_c, base_w = r["cpu"]["off"], r["wall"]["off"]
        for v in ("capture only", "no location", "online"):
            per_rec = (r["cpu"][v] - base_c) / max(r["records_per_step"], 1) * 1e6
            print(f"  {r['model']:5s} {v:13s} CPU x{r['cpu'][v] / base_c:5.2f}   wall x{r['wall'][v] / base_w:5.2f}   "
                  f"{per_rec:7.1f} us/record")
    print("\nlocation (module path and source line of each call: npu_agent.location)")
    for r in results:
        hooks = (r["cpu"]["capture only"] - r["cpu"]["no location"]) / max(r["records_per_step"], 1) * 1e6
        print(f"  {r['model']:5s} location.current() {r['location_us']:6.2f} us per captured call "
              f"({r['location_calls']} calls timed); capture only - no location: {hooks:6.1f} us/record "
              "(noisy)")
    if coll is not None:
        print(f"\ncollectives (2 gloo ranks, float32 x {ns.collective_numel}, {ns.collective_iters} calls x 3 blocks "
              f"each; {int(coll['records'])} records captured on rank 0)")
        for api in ("all_reduce", "all_gather"):
            plain, captured = coll[f"{api} plain"], coll[f"{api} captured"]
            print(f"  {api:11s} plain {plain * 1e6:9.1f} us/call   captured {captured * 1e6:9.1f} us/call   "
                  f"x{captured / plain:5.2f}")


if __name__ == "__main__":
    main()
