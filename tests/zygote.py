"""Training subprocesses without paying torch's import each time: one helper process imports torch (and
torch._dynamo, which every optimizer's constructor imports) once, then forks a child per training.

About 90 % of a small test training's CPU time is `import torch` plus the torch._dynamo import that
`torch.optim.Optimizer.__init__` triggers (about 5 s on the 2-core CI machine); the training itself takes well under
a second. A forked child is still its own process: its own pid, environment, working directory, argv, stdout and
stderr (files, read back as a CompletedProcess), exit status and atexit hooks (the script runs as `__main__` and the
child leaves through the interpreter's normal exit). The helper itself imports nothing of this project and no gRPC
(neither is fork-safe once started), runs no torch op (no thread pool exists when it forks), and sets the child's
intra-op thread count from its OMP_NUM_THREADS, which torch reads only at import.

`run(script, args, env, cwd, timeout)` is what tests/support.py's `run_training` uses; set TESTS_FRESH_PYTHON=1 to
start every training as a fresh interpreter instead (`python -c`).
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
import json, os, select, sys, traceback
import torch, torch._dynamo, torch.nn, torch.optim   # what every training imports; nothing else
import torch.nn.functional
proto_in, proto_out = 0, os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
default_threads = torch.get_num_threads()


def send(line):
    os.write(proto_out, (line + "\n").encode())


def child(req):
    os.close(proto_out)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    os.dup2(os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os.chdir(req["cwd"] or os.getcwd())
    os.environ.clear()
    os.environ.update(req["env"])
    threads = req["env"].get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else default_threads)
    sys.argv = ["-c", *req["args"]]
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
_helper: "_Helper | None" = None


class _Helper:
    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen([sys.executable, "-c", HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
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
                raise RuntimeError("the training helper did not fork")
            if req["id"] not in self._pids:
                raise RuntimeError("the training helper died")
            return self._pids.pop(req["id"])

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._cv:
            self._cv.wait_for(lambda: pid in self._exits or not self.alive(), timeout)
            if pid not in self._exits and not self.alive():
                raise RuntimeError("the training helper died")
            return self._exits.pop(pid, None)


def _get() -> _Helper:
    global _helper
    with _lock:
        if _helper is None or not _helper.alive():
            _helper = _Helper()
        return _helper


def run(script: str, args: tuple[str, ...], env: dict[str, str], cwd: str | None,
        timeout: float | None) -> subprocess.CompletedProcess:
    """Like `subprocess.run([python, "-c", script, *args], capture_output=True, text=True, env=env, cwd=cwd,
    timeout=timeout)`, with the training forked from the helper."""
    if os.environ.get("TESTS_FRESH_PYTHON") == "1":
        return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="training-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        helper = _get()
        pid = helper.start({"script": script, "args": list(args), "env": dict(env), "cwd": cwd or os.getcwd(),
                            "stdout": out, "stderr": err})
        code = helper.wait(pid, timeout)
        timed_out = code is None
        if timed_out:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            helper.wait(pid, 30)

        def read(path: str) -> str:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    return fh.read()
            except OSError:
                return ""

        cmd = [sys.executable, "-c", script, *args]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout or 0, read(out), read(err))
        return subprocess.CompletedProcess(cmd, code, read(out), read(err))
