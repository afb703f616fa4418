"""The replay workers' fork server: one process loads torch and the meta kernels once and forks every replay worker
the server asks for (docs/design.md §6.8).

A replay worker interpreter spends about 2.7 s of CPU before its first replay: `import torch` (1.4 s), then the meta
kernels its dry runs need, which import sympy and torch._dynamo (1.3 s). gpu-server used to start one interpreter
per worker, and another for each worker it replaced (a crash, the memory cap, the time limit), each paying that again.
Now `gpu-server` imports torch, forks this process (`fork_here`, called by gpu_server/replay/prestart.py), and goes
on with its start while this process loads the meta kernels; then it forks one replay worker per request in a few
milliseconds. A process that cannot fork it safely (one running threads) starts it as an interpreter of its own
(`python -m gpu_server.replay.fork_server --sock FD`), which imports torch itself.

* **The request.** The server sends one request per worker on a Unix socket: a request number and the worker's two
  pipe ends (SCM_RIGHTS). The fork server answers the number and the worker's pid; the worker then reads its
  arguments from its pipe, as a fresh interpreter does (gpu_server/replay/sandbox_worker.py).
* **The worker is the server's child.** The fork server forks a short-lived child that forks the worker and exits,
  so the worker's parent becomes the nearest subreaper above it: `gpu-server`, which made itself one
  (`become_subreaper`). The server waits for its workers as for any child (their exit status names the signal that
  ended one, for the quarantine's message), and a worker's parent-death signal points at the server, not at this
  process (`_worker`).
* **Fork safety.** The server forks this process before it starts any thread, opens any transport or reads any key
  or record: with torch imported and no torch operation run (or starts it fresh, `main`). This process runs no
  thread pool of torch's before it forks (the warm-up runs meta-device operations only: no intra-op threads, no
  CUDA), so each worker sets its thread count and device itself, as a fresh interpreter would. Its environment,
  session, working directory, standard streams and malloc arenas are those a fresh worker interpreter gets
  (prestart._environment); OpenMP's wait policy is the server's, which libgomp read when the server loaded torch
  (gpu_server/omp_wait.py: the same value).
* **Its end.** It dies with the server (a parent-death signal), ignores SIGINT and SIGTERM as the workers do (its
  own session), and exits once the server closes the socket.

This module imports torch only in the fork server process itself (`_run`); the server's side (`Client`) does not.
"""
from __future__ import annotations

import ctypes
import io
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from gpu_server import malloc_policy

_REQUEST = struct.Struct("<q")          # the request number; the two pipe ends ride along (SCM_RIGHTS)
_ANSWER = struct.Struct("<qq")          # the request number, the worker's pid (0: it could not be forked)
_PID = struct.Struct("<q")              # the worker's pid, from the short-lived child in between to the fork server
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NAME = 15
WORKER_NAME = b"gpu-replay"             # a replay worker's name in ps and top (/proc/PID/comm), forked or not
FORK_SERVER_NAME = b"gpu-replay-fork"   # this process's
_REPARENT_TIMEOUT_S = 10.0
KILL_WAIT_S = 5.0                       # how long `ForkedWorker.kill` waits for a fork still to come


def prctl(option: int, value: int | bytes) -> bool:
    """Linux's prctl(option, value) for this process; False where it failed or there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arg = ctypes.c_char_p(value) if isinstance(value, bytes) else ctypes.c_ulong(value)
        return int(libc.prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper(on: bool = True) -> bool:
    """Linux: this process adopts the orphans among its descendants, the forked replay workers among them (or, with
    `on` False, no longer does). False where that is not possible: the server then starts each worker as a fresh
    interpreter."""
    return sys.platform.startswith("linux") and prctl(_PR_SET_CHILD_SUBREAPER, int(on))


def name_this_process(name: bytes) -> None:
    """The name `ps -o comm` and `top` show (Linux; elsewhere nothing changes)."""
    if sys.platform.startswith("linux"):
        prctl(_PR_SET_NAME, name)


# -- the server's side -----------------------------------------------------------------------------------------------
class Client:
    """The server's end of the socket to a fork server it started (`proc`). Thread-safe: each replay worker thread may
    ask for a worker, and reads the answers in whatever order they come."""

    def __init__(self, proc, sock: socket.socket):
        self.proc = proc
        self._sock = sock
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._numbers = iter(range(1, 1 << 62))
        self._answers: dict[int, int] = {}
        self._ended = False   # the socket said its last word (the fork server ended) or the server closed it

    def alive(self) -> bool:
        return not self._ended and self.proc.poll() is None

    def fork(self, to_child_r: int, from_child_w: int) -> int:
        """Ask for a worker reading `to_child_r` and writing `from_child_w` (the fork server gets its own copies of
        both); returns the request's number for `pid`. OSError when the fork server is gone."""
        with self._send_lock:
            if self._ended:
                raise OSError("the fork server is gone")
            number = next(self._numbers)
            socket.send_fds(self._sock, [_REQUEST.pack(number)], [to_child_r, from_child_w])
            return number

    def pid(self, number: int, timeout: float) -> int | None:
        """The pid of request `number`'s worker; 0 when it was not forked (the fork server failed or is gone); None
        when no answer came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._read_lock:
            while number not in self._answers:
                if self._ended:
                    return 0
                left = deadline - time.monotonic()
                ready, _, _ = select.select([self._sock], [], [], max(0.0, left))
                if not ready:
                    return None
                try:
                    data = self._sock.recv(_ANSWER.size, socket.MSG_WAITALL)
                except OSError:
                    data = b""
                if len(data) != _ANSWER.size:
                    self._ended = True   # it ended (or said what it should not): no more answers
                    continue
                k, pid = _ANSWER.unpack(data)
                self._answers[k] = pid
            return self._answers.pop(number)

    def close(self) -> None:
        """End the fork server (the workers it forked are the server's and go on)."""
        with self._send_lock, self._read_lock:
            self._ended = True
            try:
                self._sock.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Child:
    """A process this one forked itself, answering like the `subprocess.Popen` of a fresh one (`pid`, `poll`,
    `wait`, `kill`, `returncode`)."""

    def __init__(self, pid: int | None):
        self._pid = pid
        self.returncode: int | None = None

    @property
    def pid(self) -> int | None:
        return self._known(0.0)

    def _known(self, timeout: float) -> int | None:
        """Its pid (`ForkedWorker`: once known)."""
        return self._pid

    def poll(self) -> int | None:
        """None while it runs (or is being forked), else its exit code (negative: the signal that ended it)."""
        pid = self._known(0.0)
        if self.returncode is not None or pid is None:
            return self.returncode
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:   # not (or no longer) ours to wait for: it is gone
            self.returncode = -int(signal.SIGKILL)
            return self.returncode
        if got == pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; subprocess.TimeoutExpired after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"process {self._pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL."""
        pid = self._known(0.0)
        if pid is not None and self.returncode is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkedWorker(Child):
    """A replay worker forked by the fork server: this process's child once the fork server has answered."""

    def __init__(self, client: Client, number: int, start_timeout: float):
        super().__init__(None)
        self._client = client
        self._number = number
        self._start_timeout = start_timeout

    def _known(self, timeout: float) -> int | None:
        """Its pid once the fork server has answered (waiting up to `timeout`); None before. A request it could not
        fork ends with returncode 1."""
        if self._pid is None and self.returncode is None:
            pid = self._client.pid(self._number, timeout)
            if pid == 0:
                self.returncode = 1
            elif pid is not None:
                self._pid = pid
        return self._pid

    def kill(self) -> None:
        """SIGKILL. One not forked within `KILL_WAIT_S` (a fork server still starting, or stuck) counts as killed:
        forked later, it finds its pipe closed (the server closes it first) and exits before it replays anything."""
        pid = self._known(min(KILL_WAIT_S, self._start_timeout))
        if pid is None:
            if self.returncode is None:
                self.returncode = -int(signal.SIGKILL)
            return
        super().kill()


# -- the fork server process -------------------------------------------------------------------------------------------
def _worker(fds: list[int], server: int, sandbox_worker) -> int:
    """In the forked worker, once its parent is the server (module docstring): the replay worker's own start."""
    deadline = time.monotonic() + _REPARENT_TIMEOUT_S
    while os.getppid() != server:   # the short-lived child in between exits at once
        if time.monotonic() > deadline:
            return 0   # the server is gone (its orphans went elsewhere): nothing to replay for
        time.sleep(0.0005)
    return int(sandbox_worker.main(["--rfd", str(fds[0]), "--wfd", str(fds[1])]))


def _fork(fds: list[int], sock: socket.socket, sandbox_worker) -> int:
    """Fork one worker through a short-lived child (module docstring); its pid, or 0."""
    server = os.getppid()
    r, w = os.pipe()
    between = os.fork()
    if between == 0:   # the child in between
        code = 0
        try:
            os.close(r)
            worker = os.fork()
            if worker == 0:
                os.close(w)
                sock.close()
                try:
                    code = _worker(fds, server, sandbox_worker)
                except BaseException:  # noqa: BLE001 - never back into the fork server's loop
                    import traceback

                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            os.write(w, _PID.pack(worker))
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        data = os.read(r, _PID.size)
    finally:
        os.close(r)
    os.waitpid(between, 0)   # once it is gone, the worker's parent is the server
    return _PID.unpack(data)[0] if len(data) == _PID.size else 0


def serve(sock: socket.socket, sandbox_worker) -> None:
    """Answer fork requests until the server closes the socket."""
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(sock, _REQUEST.size, 2)
        except OSError:
            return
        if not message:
            for fd in fds:
                os.close(fd)
            return
        try:
            pid = _fork(fds, sock, sandbox_worker) if len(message) == _REQUEST.size and len(fds) == 2 else 0
        except OSError as exc:   # no memory or no pid left for a fork: this request gets no worker
            print(f"gpu-server replay fork server: could not fork a replay worker ({exc})", file=sys.stderr)
            pid = 0
        finally:
            for fd in fds:
                os.close(fd)
        number = _REQUEST.unpack(message)[0] if len(message) == _REQUEST.size else 0
        try:
            sock.sendall(_ANSWER.pack(number, pid))
        except OSError:
            return


def _unbuffered_output() -> None:
    """stdout and stderr written through at once, as PYTHONUNBUFFERED gives a fresh interpreter: a worker's last words
    reach the server's log before it is killed."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        try:
            raw = open(fd, "wb", buffering=0, closefd=False)
        except OSError:
            continue
        setattr(sys, name, io.TextIOWrapper(raw, encoding=getattr(old, "encoding", None) or "utf-8",
                                            errors=getattr(old, "errors", None) or "backslashreplace",
                                            write_through=True))


def _run(sock: socket.socket) -> int:
    """The fork server's life (`fork_here`'s child, or `main`'s interpreter)."""
    # as a worker does (sandbox_worker.main): the server ends this process, not a signal to its process group
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name_this_process(FORK_SERVER_NAME)
    from gpu_server.replay import sandbox_worker  # imports torch (a no-op where the server had imported it)

    sandbox_worker._die_with_the_server()
    sandbox_worker._warm_up_any_device()
    serve(sock, sandbox_worker)
    return 0


def fork_here(sock: socket.socket, server_end: socket.socket, env: dict[str, str], cwd: str) -> Child:
    """Start the fork server as a fork of this process (the server, before it has started any thread of its own),
    serving `sock`; `server_end` is the socket's other end, which it closes. It runs in a session of its own, with
    `env` and `cwd` and no standard input, as a fresh interpreter started for it would; what this process has
    imported (torch) it does not import again. Returns the child."""
    for stream in (sys.stdout, sys.stderr):   # what is buffered is this process's to write, once
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    pid = os.fork()
    if pid:
        return Child(pid)
    code = 1
    try:
        server_end.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        malloc_policy.limit_arenas(malloc_policy.WORKER_ARENAS)
        _unbuffered_output()
        code = _run(sock)
    except BaseException:  # noqa: BLE001 - never back into the server's code
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """The fork server as an interpreter of its own, for a server that cannot fork it (prestart.start)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--sock" or not args[1].isdigit():
        print("usage: python -m gpu_server.replay.fork_server --sock FD (started by gpu-server)", file=sys.stderr)
        return 2
    return _run(socket.socket(fileno=int(args[1])))


if __name__ == "__main__":
    sys.exit(main())
