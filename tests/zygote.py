"""Trainings and servers without paying torch's import each time: one helper process imports torch once, then
forks a child per training (or per `gpu-server`).

About 90 % of a small test training's CPU time is `import torch` plus the torch._dynamo import that
`torch.optim.Optimizer.__init__` triggers (about 5 s on the 2-core CI machine); the training itself takes well under
a second. A test server started as the `gpu-server` command costs about 3 s of CPU before it serves, half of it
`import torch`, and the suite starts about a hundred of them. A forked child is still its own process: its own pid,
environment, working directory, argv, stdout and stderr (files), signals, exit status and atexit hooks (the script
runs as `__main__` and the child leaves through the interpreter's normal exit). The helper imports no gRPC (not
fork-safe once started), runs no torch op on a real device (no thread pool exists when it forks), and sets the
child's intra-op thread count from its OMP_NUM_THREADS, which torch reads only at import. The server helper also
loads the meta kernels, as each server's fork server would (gpu_server/replay/fork_server.py: a fork of the server,
1.3 s of CPU each): meta-device operations only, through the project's own warm-up. (When the fork server was a
fresh interpreter, it imported torch and the meta kernels for every test server: 2.6 s of CPU each, a fifth of the
suite's CPU.)

There is one helper per kind of child, since what libgomp and torch read once, when they are loaded, must be what
that kind's fresh interpreter would have read: trainings get the test process's environment (less the thread counts,
set per child); servers get OMP_WAIT_POLICY=PASSIVE unless the environment names a policy, as `gpu-server` sets it
for itself before it imports torch (gpu_server/omp_wait.py).

`run(script, args, env, cwd, timeout)` is what tests/support.py's `run_training` uses, `spawn(...)` what its `Server`
uses (a `Forked`, which answers like a `subprocess.Popen`); set TESTS_FRESH_PYTHON=1 to start every training and
server as a fresh interpreter instead (`python -c`, the `gpu-server` command).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

# The helper: reads one JSON request per line on stdin, answers "PID <id> <pid>" and "EXIT <pid> <status>" on stdout.
HELPER = r'''
import importlib, json, os, select, sys, traceback
import torch
for name in filter(None, sys.argv[1].split(",")):   # what every child of this kind imports; nothing else
    importlib.import_module(name)
if sys.argv[2]:   # what every child of this kind would run first, where it creates no thread (module:function)
    module, function = sys.argv[2].split(":")
    getattr(importlib.import_module(module), function)()
proto_in, proto_out = 0, os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
default_threads = torch.get_num_threads()


def send(line):
    os.write(proto_out, (line + "\n").encode())


def child(req):
    os.close(proto_out)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if req.get("append") else os.O_TRUNC)
    out = os.open(req["stdout"], flags, 0o644)
    err = out if req["stderr"] == req["stdout"] else os.open(req["stderr"], flags, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err}:
        os.close(fd)
    os.chdir(req["cwd"] or os.getcwd())
    os.environ.clear()
    os.environ.update(req["env"])
    threads = req["env"].get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else default_threads)
    sys.argv = [req.get("argv0") or "-c", *req["args"]]
    code, exit_, print_exc = compile(req["script"], "<string>", "exec"), sys.exit, traceback.print_exc
    main_vars = globals()     # this helper runs as __main__: the script gets a clean __main__ instead
    for k in [k for k in main_vars if k not in ("__builtins__", "__name__", "__doc__", "__spec__", "__loader__",
                                                "__package__")]:
        del main_vars[k]
    try:
        exec(code, main_vars)
    except SystemExit:
        raise
    except BaseException:
        print_exc()
        exit_(1)
    exit_(0)


def main():
    buf, live = b"", set()
    while True:
        ready, _, _ = select.select([proto_in], [], [], 0.02 if live else 1.0)
        if ready:
            chunk = os.read(proto_in, 1 << 20)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(req)          # never returns: sys.exit unwinds to the interpreter's normal exit
                live.add(pid)
                send(f"PID {req['id']} {pid}")
        for pid in list(live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                live.discard(pid)
                send(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}")


main()
'''

_lock = threading.Lock()
_helpers: dict[str, _Helper] = {}


# what each kind of child imports besides torch, before the fork
IMPORTS = {"training": "torch._dynamo,torch.nn,torch.optim,torch.nn.functional", "server": ""}
# what each kind runs before the fork: a server's fork server (gpu_server/replay/fork_server.py, a fork of the server)
# loads the meta kernels its workers' dry runs need, using the meta device only (no thread pool, no CUDA), 1.3 s of
# CPU a server; done here once, every server's fork server finds them loaded
WARM_UP = {"training": "", "server": "gpu_server.replay.sandbox_worker:_warm_up_any_device"}


class _Helper:
    def __init__(self, kind: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if kind == "server":
            from gpu_server import omp_wait  # (imports nothing heavy)

            omp_wait.passive(env)
        self.proc = subprocess.Popen([sys.executable, "-c", HELPER, IMPORTS[kind], WARM_UP[kind]],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._cv = threading.Condition()
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True, name="zygote-reader")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            kind, a, b = raw.decode().split()
            with self._cv:
                if kind == "PID":
                    self._pids[int(a)] = int(b)
                else:
                    self._exits[int(a)] = int(b)
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, req: dict) -> int:
        with self._cv:
            self._next += 1
            req = dict(req, id=self._next)
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            if not self._cv.wait_for(lambda: req["id"] in self._pids or not self.alive(), 60):
                raise RuntimeError("the zygote helper did not fork")
            if req["id"] not in self._pids:
                raise RuntimeError("the zygote helper died")
            return self._pids.pop(req["id"])

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._cv:
            self._cv.wait_for(lambda: pid in self._exits or not self.alive(), timeout)
            if pid not in self._exits and not self.alive():
                raise RuntimeError("the zygote helper died")
            return self._exits.pop(pid, None)


def _get(kind: str = "training") -> _Helper:
    with _lock:
        helper = _helpers.get(kind)
        if helper is None or not helper.alive():
            helper = _helpers[kind] = _Helper(kind)
        return helper


def fresh() -> bool:
    """TESTS_FRESH_PYTHON=1: every training and server a fresh interpreter."""
    return os.environ.get("TESTS_FRESH_PYTHON") == "1"


class Forked:
    """A child forked by a helper, answering as much of `subprocess.Popen` as the tests use: `pid`, `returncode`,
    `poll`, `wait` (raising TimeoutExpired), `send_signal`, `terminate`, `kill`. Its exit status is the helper's
    `os.waitstatus_to_exitcode`: negative for a signal, as Popen's."""

    def __init__(self, helper: _Helper, pid: int, args: list[str]):
        self._helper, self.pid, self.args = helper, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._helper.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._helper.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:   # (not yet reaped by the helper: the pid is still this child's)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(kind: str, script: str, args: list[str], env: dict[str, str], cwd: str, log: str,
          argv0: str = "") -> Forked:
    """Start `script` (run as `__main__`, `sys.argv` = [argv0, *args]) forked from the `kind` helper, its stdout
    and stderr appended to `log`; it runs until it exits (`Forked.wait`)."""
    helper = _get(kind)
    pid = helper.start({"script": script, "args": list(args), "env": dict(env), "cwd": cwd, "stdout": log,
                        "stderr": log, "append": True, "argv0": argv0})
    return Forked(helper, pid, [argv0 or sys.executable, *args])


def run(script: str, args: tuple[str, ...], env: dict[str, str], cwd: str | None,
        timeout: float | None) -> subprocess.CompletedProcess:
    """Like `subprocess.run([python, "-c", script, *args], capture_output=True, text=True, env=env, cwd=cwd,
    timeout=timeout)`, with the training forked from the helper."""
    if fresh():
        return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="training-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        helper = _get()
        cmd = [sys.executable, "-c", script, *args]
        child = Forked(helper, helper.start({"script": script, "args": list(args), "env": dict(env),
                                             "cwd": cwd or os.getcwd(), "stdout": out, "stderr": err}), cmd)

        def read(path: str) -> str:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    return fh.read()
            except OSError:
                return ""

        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                pass
            raise subprocess.TimeoutExpired(cmd, timeout or 0, read(out), read(err)) from None
        return subprocess.CompletedProcess(cmd, code, read(out), read(err))
