"""Shared test machinery: real gpu-server processes on loopback, real training scripts in subprocesses, reading
the reports back. Every end-to-end test uses these instead of its own copy."""
from __future__ import annotations

import csv
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


# A small MLP trained under the agent. argv: config[, steps (default 2)[, "info": the agent's INFO lines, its counts
# at close among them, on stderr; they are shown only when asked for]]. Prints "COUNTS {json}" (the agent's close())
# and "TRAINING DONE <last loss>".
SMALL_TRAIN = r'''
import json, logging, sys, torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger
if len(sys.argv) > 3 and sys.argv[3] == "info":
    logging.basicConfig(level=logging.INFO)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
dbg = PrecisionDebugger(config_path=sys.argv[1])
for step in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    dbg.start()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    dbg.stop()
    dbg.step()
print("COUNTS " + json.dumps(dbg.close()))
print("TRAINING DONE", float(loss))
'''


def built(compiled: Any) -> Any:
    """The module of `compiled` (protos.compiled.Compiled), built here if the set-up did not build it
    (scripts/setup.sh does), loaded afresh."""
    if not compiled.binary_path().exists():
        compiled.build(quiet=True)
    compiled.loaded.clear()
    module = compiled.load()
    assert module is not None, f"{compiled.source.name} did not load"
    return module


def memory_of(pid: int, field: str = "VmHWM") -> int:
    """A process's memory in bytes from /proc/PID/status: VmHWM (its peak RSS, the default) or VmRSS (now)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module", autouse=True)
def forked_replay_workers():
    """Imported by a test module: the replay workers its `ProcessReplayer`s start are forked by one fork server, as
    gpu-server's are (gpu_server/replay/fork_server.py; here an interpreter of its own, since this process runs
    threads), instead of each being a fresh interpreter: 2.7 s of CPU once for the module instead of 3.4 s a worker.
    This process is a subreaper meanwhile (the workers are its children); the fork server ends with the module."""
    from gpu_server.replay import prestart

    prestart.start(1)
    try:
        yield
    finally:
        prestart.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_config(path: str, port: int = 0, nfs_path: str = "", tls_path: str = "", rank_list=(), **extra) -> str:
    run_ut = {"white_list": [], "black_list": [], "error_data_path": "./", "is_online": True, "nfs_path": nfs_path,
              "host": "127.0.0.1", "port": port, "rank_list": list(rank_list), "tls_path": tls_path}
    run_ut.update(extra)
    with open(path, "w") as fh:
        json.dump({"task": "run_ut", "run_ut": run_ut}, fh)
    return path


def agent_config(path: str, port: int = 0, nfs_path: str = "", tls_path: str = "", host="127.0.0.1", **tensor) -> str:
    t = {"scope": [], "list": [], "online_run_ut": True, "nfs_path": nfs_path, "host": host, "port": port,
         "tls_path": tls_path, "online_run_ut_recompute": False}
    t.update(tensor)
    with open(path, "w") as fh:
        json.dump({"task": "tensor", "dump_path": os.path.join(os.path.dirname(path), "dump"), "level": "L1",
                   "rank": [], "step": [], "tensor": t}, fh)
    return path


# what the `gpu-server` command runs
SERVER_MAIN = "import sys\nfrom gpu_server.cli import main\nsys.exit(main())\n"


class Server:
    """A real `gpu-server` process: its command's main forked from a helper that imported torch (tests/zygote.py),
    or with `fresh=True` (or TESTS_FRESH_PYTHON=1) the command itself. Use as a context manager; `stop()` sends
    SIGTERM and waits."""

    def __init__(self, workdir: str, port: int | None = None, args=(), out: str | None = None, fresh: bool = False,
                 session: bool = False, **config):
        self.workdir = workdir
        self.fresh = fresh or session   # a fresh interpreter (the `gpu-server` command) even where others are forked
        self.session = session   # in a session (and process group) of its own, as a shell's foreground job is
        self.out = out or os.path.join(workdir, "out")
        self._config_keys = config
        self._port_picked = port is None   # picked here: another may bind it before the server does (start retries)
        self._use_port(free_port() if port is None else port)
        self.args = list(args)
        self.proc: subprocess.Popen | Any | None = None   # a Popen or a zygote.Forked
        self.nfs = bool(config.get("nfs_path"))

    def _use_port(self, port: int) -> None:
        self.port = port
        self.config = server_config(os.path.join(self.workdir, f"server_{port}.json"), port, **self._config_keys)
        self.log_path = os.path.join(self.workdir, f"server_{port}.log")

    def start(self, wait: float = 60) -> "Server":
        """Start the server and wait until it serves. A port picked by `free_port` is free only when picked: should
        another process bind it before the server does (it then exits: "cannot bind"), the server starts again on
        another port, at most three times."""
        for _ in range(2):
            try:
                return self._start(wait)
            except _PortTaken:
                self._use_port(free_port())
        try:
            return self._start(wait)
        except _PortTaken as taken:
            raise RuntimeError(f"gpu-server found the port taken three times: {self.log()}") from taken

    def _start(self, wait: float) -> "Server":
        from tests import zygote

        self._log = open(self.log_path, "a")
        since = self._log.tell()    # a restart on the same port appends to the same log
        cmd = [os.path.join(os.path.dirname(PY), "gpu-server"), "--config", self.config, "--out", self.out,
               "--quiet", *self.args]
        if self.fresh or zygote.fresh():
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         start_new_session=self.session)
        else:   # the same command's main, in a process forked once torch is imported (tests/zygote.py)
            self.proc = zygote.spawn("server", SERVER_MAIN, cmd[1:], dict(os.environ), self.workdir, self.log_path,
                                     argv0=cmd[0])
        deadline = time.time() + wait
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                if self._port_picked and not self.nfs and "cannot bind" in self._log_since(since):
                    raise _PortTaken(self.port)
                raise RuntimeError(f"gpu-server exited with {self.proc.returncode}: {self.log()}")
            # the line the server logs once started (spool resumed, port open): a SIGTERM before it kills the
            # process instead of draining it (gpu_server/cli.py installs its handlers after app.start())
            if ("watching shared folder" if self.nfs else "listening on") in self._log_since(since):
                if self.nfs:
                    return self
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", self.port)) == 0:
                        return self
            time.sleep(0.05)
        raise RuntimeError(f"gpu-server did not start: {self.log()}")

    def stop(self, timeout: float = 120) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", "replace")

    def log(self) -> str:
        try:
            with open(self.log_path) as fh:
                return fh.read()
        except OSError:
            return ""

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.stop()


class _PortTaken(Exception):
    """The port `free_port` picked for a server was bound by another process before the server bound it."""


def run_training(script: str, *args: str, env: dict | None = None, timeout: float = 300,
                 cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run a training script (source text) in its own process (tests/zygote.py: forked from a helper that has
    imported torch); fail the test if it fails."""
    from tests import zygote

    full_env = dict(os.environ, PYTHONPATH=ROOT)
    full_env.update(env or {})
    proc = zygote.run(script, args, full_env, cwd, timeout)   # a forked child of a torch-imported helper
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


class Training:
    """`run_training` in a background thread, for tests that act while it runs: `is_alive()`, then `result()`
    gives its CompletedProcess or raises what failed it."""

    def __init__(self, script: str, *args: str, env: dict | None = None, timeout: float = 300,
                 cwd: str | None = None):
        import threading

        self._out: dict = {}
        self._thread = threading.Thread(target=self._run, args=(script, args, env, timeout, cwd), daemon=True)
        self._thread.start()

    def _run(self, script, args, env, timeout, cwd) -> None:
        try:
            self._out["proc"] = run_training(script, *args, env=env, timeout=timeout, cwd=cwd)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._out["error"] = exc

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def error(self) -> BaseException | None:
        return self._out.get("error")

    def result(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the training did not finish within {timeout} s")
        if "error" in self._out:
            raise self._out["error"]
        return self._out["proc"]


def run_ranks(script: str, jobs: list[tuple[list[str], dict]],
              timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Run `script` once per job (its arguments, its environment) at the same time, job i being rank i; their
    CompletedProcesses in rank order. A failed rank fails the test, named."""
    trainings = [Training(script, *args, env=env, timeout=timeout) for args, env in jobs]
    for training in trainings:        # every rank has ended (or timed out) before one failure is raised
        training.join(timeout + 30)
    done = []
    for rank, training in enumerate(trainings):
        try:
            done.append(training.result(0))
        except BaseException as exc:
            raise AssertionError(f"rank {rank} failed") from exc
    return done


def stream_acks(port: int, messages: list[bytes], until, timeout: float = 30, credentials=None) -> list:
    """Send raw messages (serialized Frames, or any bytes) on one Stream call of a generic gRPC client to
    127.0.0.1:`port`, keeping the stream open until `until(acks)` holds for the acknowledgements read so far;
    return them. A refused or failed call raises grpc.RpcError (after `timeout` at the latest)."""
    import threading

    import grpc

    from protos import online_check_pb2 as pb
    from protos.contract import STREAM_METHOD

    target, options = f"127.0.0.1:{port}", [("grpc.max_send_message_length", -1)]
    channel = (grpc.secure_channel(target, credentials, options) if credentials is not None
               else grpc.insecure_channel(target, options))
    with channel:
        stub = channel.stream_stream(STREAM_METHOD, request_serializer=None, response_deserializer=pb.Ack.FromString)
        done = threading.Event()

        def requests():
            yield from messages
            done.wait(timeout)  # keep the stream open until the answers are in

        acks: list = []
        call = stub(requests(), timeout=timeout)
        try:
            for ack in call:
                acks.append(ack)
                if until(acks):
                    break
        finally:
            done.set()
            call.cancel()
        return acks


def read_csv(out_dir: str, kind: str, rank: int = 0) -> list[dict]:
    """Rows of `{kind}_*_rank{rank}.csv` (kind: accuracy_checking_result, accuracy_checking_details,
    api_precision_compare_result, api_precision_compare_details), as dicts by header."""
    rows: list[dict] = []
    for path in sorted(glob.glob(os.path.join(out_dir, f"{kind}_*_rank{rank}.csv"))):
        with open(path, encoding="utf-8-sig", newline="") as fh:
            rows.extend(csv.DictReader(fh))
    return rows


def read_header(out_dir: str, kind: str, rank: int = 0) -> list[str]:
    paths = sorted(glob.glob(os.path.join(out_dir, f"{kind}_*_rank{rank}.csv")))
    with open(paths[0], encoding="utf-8-sig", newline="") as fh:
        return next(csv.reader(fh))


def by_name(rows: list[dict], key: str = "API name") -> dict[str, dict]:
    return {r[key]: r for r in rows}


def to_job(rec, run_id: str = "test", rank: int = 0):
    """A captured PendingRecord through the real wire encoding and the server's decoder, as the server sees it."""
    from gpu_server.decode import decode_job
    from gpu_server.intake.assembler import FrameAssembler
    from npu_agent.records import encode_record
    from protos import online_check_pb2 as pb

    if rec.seq < 0:
        rec.seq = 0
    enc = encode_record(rec, run_id, rank)
    asm = FrameAssembler()
    done = None
    for frame in enc.wire_frames(1 << 20):
        done = asm.feed(pb.Frame.FromString(frame))
    assert done is not None, "frames did not complete a record"
    return decode_job(*done)


class ListSink(list):
    """Collects PendingRecords in place of the sender (in-process capture tests)."""

    def forward(self, name: str):
        return next(r for r in self if r.name == name and r.direction == 1)

    def backward(self, name: str):
        return next(r for r in self if r.name == name and r.direction == 2)

    def names(self, direction: int = 1) -> list[str]:
        return [r.name for r in self if r.direction == direction]


def capture(sink: ListSink | None = None, backward: bool = True):
    """An in-process capture mode writing to a ListSink: `with capture() as (mode, sink): ...`."""
    import contextlib

    from npu_agent import checkpoint
    from npu_agent.backward import BackwardTaps
    from npu_agent.capture import CaptureMode, Capturer

    sink = ListSink() if sink is None else sink
    taps = BackwardTaps(sink.append) if backward else None
    cap = Capturer(sink.append, backward=taps)
    checkpoint.install()
    mode = CaptureMode(cap)

    @contextlib.contextmanager
    def ctx():
        yield mode, sink
        cap.release_regions()
        if taps is not None:
            taps.end_step()

    return ctx()
