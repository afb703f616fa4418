"""Transport throughput, side by side in one run on loopback (docs/design.md §5, §8: ratios, not promises).

    python bench/transport.py            # 4 KiB (20,000 records), 64 KiB, 1 MiB, 16 MiB (~256 MiB each, each row
                                         # run 3 times, alternating; ~15 min)
    python bench/transport.py --quick    # a smoke run (~32 MiB each, 5,000 small records)
    python bench/transport.py --mib 128 --baseline /tmp/base   # also "before" rows: another checkout's agent and
                                                                # server (e.g. the previous main), same run
    python bench/transport.py --sizes 4k,1m --rows ours,raw     # only some sizes and transports
    python bench/transport.py --repeat 1                        # each row once (a third of the time, noisier)
    python bench/transport.py --rtt-ms 2                        # as across a network with 2 ms of round trip

For each tensor size it measures, with the receiving side in a separate process, after one warm-up record (the
connection and TLS handshake are not timed):

* ours (gRPC):   the real agent path: Sender + GrpcTransport -> gpu_server StreamHandler + Intake (decode included;
                 the intake's dispatch only counts, so no replay), until every record is acknowledged; small
                 records that queue up travel together (Batch frames);
* one a message: the same with the sender's batching turned off;
* ours (mTLS):   the same over mutual TLS (certificates made with certs/make_certs.py in a temporary folder);
* ours (folder): Sender + FolderTransport -> a temporary folder -> FolderReader + Intake, until the reader has
                 taken the end-of-stream marker (every record read, decoded and deleted);
* raw gRPC:      a bare bytes stream: generic handler, identity (de)serializers, one message per record, split into
                 raw chunks of at most 4 MiB (the best case of reference/limits.md);
* raw mTLS:      the same bare stream over mutual TLS with the same certificates: the reference for ours (mTLS),
                 since encryption costs the same whoever sends;
* raw TCP:       the same bytes over a plain socket (sendall / recv_into);
* raw bidi:      what our protocol costs gRPC, without our code: a bidirectional stream on a `grpc.aio` server (as
                 ours), each record's bytes copied afresh from its tensor for every message (a snapshot sent through
                 Python gRPC needs that one copy: gRPC takes bytes), in messages of at most 4 MiB, and one small answer
                 back for each (the bytes received so far: ours acknowledges every record). Not a goal: it splits
                 ours / raw gRPC into what gRPC's stream with answers costs (raw bidi / raw gRPC) and what our
                 sender, framing, intake and acknowledgements cost above it (ours / raw bidi).

Every receiving child runs with gpu-server's malloc thresholds (gpu_server/malloc_policy.py), as gpu-server does,
the bare streams' children too, so that ours and its floor keep freed memory alike: with them, bare gRPC moved
64 KiB to 16 MiB records 1.2-1.3x faster on this VM, ours 0.95-1.1x. The sending process takes the thresholds
the agent sets in a training's process when it starts (npu_agent/freed_memory.py, for the senders' budget), before
any row, so that every row sends with them.

Each row runs `--repeat` times (default 3), the rows (and the baseline's) taking turns, and its fastest run is
printed: a row takes well under a second at 64 KiB, and one run of raw gRPC read 9,426 records/s, the next 15,259.
Where the fastest row of a size took under a quarter of a second, a note under the rows names the `--mib` that makes
them last longer. On a fast day of the AMD EPYC VM (2026-12-07) a row of 256 MiB of 1 MiB records took 0.07-0.14 s,
and five runs of `--sizes 1m,16m --rows ours,raw --repeat 1` gave ours/raw gRPC 0.82, 0.58, 0.82, 1.08 and 0.68 at
1 MiB; with `--mib 1024` (rows of 0.31-0.41 s) four runs gave 0.67, 0.68, 0.71 and 0.69.
It prints MB/s, records/s and the CPU time per record of the sending and the receiving process (the receiver's
from /proc, in clock ticks) of that run, under them the CPU a record of each of the agent's threads in the sending
process for our rows (bench/measuring.py `thread_cpu`: the sender, the stream's reader, gRPC's Python threads and
its C core; the submitting thread's is the rest), then the ratios of the fastest runs: ours / raw gRPC (the goal:
>= 0.9), ours (mTLS) / raw mTLS (the same goal), mTLS / raw gRPC (what encryption costs), ours / raw TCP, ours / raw
bidi and raw bidi / raw gRPC (the two parts of the goal's ratio), batched / one a message, folder / ours.

With `--rtt-ms R` every row but the folder's sends through a relay on loopback that holds each byte R/2 ms each way
(bench/delay_relay.py), as a network between the training's host and the server's would: what the receiver's
flow-control window allows then shows (at most one window in flight per round trip). The relay's CPU is in neither
column.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "--root" in sys.argv[:-1]:   # the code measured: another checkout's (--baseline runs this file with its root)
    ROOT = os.path.abspath(sys.argv[sys.argv.index("--root") + 1])
sys.path.insert(0, ROOT)

from intake import counting_intake  # noqa: E402  (bench/intake.py, beside this file)
from measuring import (  # noqa: E402  (bench/measuring.py, beside this file)
    agent_threads_line,
    agent_threads_since,
    process_stat,
    thread_cpu,
)

MiB = 1 << 20
RAW_METHOD = "/bench.Raw/Push"
BIDI_METHOD = "/bench.Raw/Bidi"
RAW_CHUNK = 4 * MiB
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]   # bare streams' options
SHORT_ROW_S = 0.25   # a size whose fastest row is shorter than this gets a note: raise --mib (module docstring)
SMALL = 4096          # small records: a 1024-float tensor each, counted in records/s
SIZES = (SMALL, 64 * 1024, MiB, 16 * MiB)


# ----------------------------------------------------------------------------------------------- receiving side


def serve(mode: str, tls_dir: str, nfs: str) -> None:
    """Runs in the child process: print 'PORT n' (or 'READY'), serve until stdin closes."""
    import grpc

    try:   # every receiving side with gpu-server's allocator thresholds (the bare streams too: the same floor)
        from gpu_server import malloc_policy
    except ImportError:   # (a --baseline checkout from before it)
        pass
    else:
        malloc_policy.keep_freed_memory()

    if mode in ("ours", "tls"):
        from gpu_server.intake.grpc_service import StreamHandler, make_server
        from protos.limits import DEFAULT_LIMITS

        intake, _, budget = counting_intake()
        handler = StreamHandler(intake, DEFAULT_LIMITS, lambda end: None, budget=budget)
        server = make_server(handler, "127.0.0.1:0", DEFAULT_LIMITS, tls_dir if mode == "tls" else "")
        port = int(server.start().rsplit(":", 1)[1])
    elif mode in ("rawgrpc", "rawtls"):
        from concurrent import futures

        def push(request_iterator, context):
            n = 0
            for msg in request_iterator:
                n += len(msg)
            return n.to_bytes(8, "little")

        server = grpc.server(futures.ThreadPoolExecutor(4), options=UNLIMITED)
        handler = grpc.stream_unary_rpc_method_handler(push, request_deserializer=None, response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Raw", {"Push": handler}),))
        if mode == "rawtls":
            from protos import tls

            port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(tls_dir))
        else:
            port = server.add_insecure_port("127.0.0.1:0")
        server.start()
    elif mode == "rawbidi":
        port = _serve_bidi()
    elif mode == "tcp":
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(4)
        port = lsock.getsockname()[1]

        def accept_loop():
            buf = bytearray(RAW_CHUNK)
            view = memoryview(buf)
            while True:
                conn, _ = lsock.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                want = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
                got = 0
                while got < want:
                    n = conn.recv_into(view, min(len(buf), want - got))
                    if not n:
                        break
                    got += n
                conn.sendall(b"k")
                conn.close()

        threading.Thread(target=accept_loop, daemon=True).start()
    elif mode == "folder":
        from gpu_server.intake.folder import FolderReader

        intake, _, _ = counting_intake()
        reader = FolderReader(nfs, intake, intake.limits, lambda end: print(f"END {end.run_id}", flush=True),
                              min_poll_s=0.002, max_poll_s=0.02)
        reader.start()
        port = 0
    print(f"PORT {port}", flush=True)
    sys.stdin.read()


def _serve_bidi() -> int:
    """The raw bidi row's receiver: a grpc.aio server on its own event-loop thread, answering every message with the
    bytes received so far on its stream (8 bytes, little-endian). Returns its port."""
    import asyncio

    import grpc

    ready: list[int] = []
    started = threading.Event()

    async def bidi(request_iterator, context):
        n = 0
        async for msg in request_iterator:
            n += len(msg)
            yield n.to_bytes(8, "little")

    async def run() -> None:
        server = grpc.aio.server(options=UNLIMITED)
        handler = grpc.stream_stream_rpc_method_handler(bidi, request_deserializer=None, response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Raw", {"Bidi": handler}),))
        ready.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        started.set()
        await server.wait_for_termination()

    threading.Thread(target=asyncio.run, args=(run(),), daemon=True).start()
    if not started.wait(60):
        raise RuntimeError("the raw bidi server did not start")
    return ready[0]


SENDER_BUDGET = 256 * MiB   # the senders' memory budget (tensor.online_memory_mb)
_RUN: dict = {}   # the run being timed: its receiving child, and the clocks at its start; then its CPU seconds
RTT_S = 0.0       # --rtt-ms: each receiving child behind a relay (bench/delay_relay.py) holding bytes RTT/2 each way


def _start() -> None:
    child = _RUN["child"]
    _RUN.update(t=time.perf_counter(), client=time.process_time(), server=child.cpu(), threads=thread_cpu())


def _stop() -> float:
    """Seconds since `_start`; leaves the CPU seconds of the sending and the receiving process in _RUN, and those of
    the agent's threads in the sending process where `run_ours` read them (bench/measuring.py
    `agent_threads_since`; else none)."""
    dt = time.perf_counter() - _RUN["t"]
    _RUN["client"] = time.process_time() - _RUN["client"]
    _RUN["server"] = _RUN["child"].cpu() - _RUN["server"]
    _RUN["threads"] = _RUN.pop("agent", None) or {}
    return dt


class Child:
    def cpu(self) -> float:
        """CPU seconds (user + system) of the receiving process so far."""
        stat = process_stat(self.proc.pid)
        assert stat is not None, "the receiving process is gone"
        return stat[1]

    def __init__(self, mode: str, tls_dir: str = "", nfs: str = ""):
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--tls", tls_dir, "--nfs", nfs,
                                      "--root", ROOT],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT"):
            raise RuntimeError(f"{mode} server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.relay = None
        if RTT_S and self.port:   # the senders connect to the relay in front of it (not the folder: no network)
            self.relay = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                        "delay_relay.py"), str(self.port),
                                           str(RTT_S / 2)], stdout=subprocess.PIPE, text=True)
            self.port = int(self.relay.stdout.readline().split()[1])
        _RUN["child"] = self

    def wait_line(self, prefix: str) -> str:
        while True:
            line = self.proc.stdout.readline()
            if not line or line.startswith(prefix):
                return line

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait()
        if self.relay is not None:
            self.relay.kill()
            self.relay.wait()


# ----------------------------------------------------------------------------------------------- sending side


def _records(size: int, n: int):
    import torch

    from npu_agent.records import PendingRecord
    from npu_agent.snapshot import snapshot

    t = torch.randn(size // 4, dtype=torch.float32)
    # one tensor referenced by every record (a snapshot holds references; encoding copies it into the payload and
    # lets the snapshot go, so each record needs its own)
    return [PendingRecord(name=f"Functional.relu.{i}", step=0, inputs=snapshot(((t,), {}))) for i in range(n)]


def run_ours(make_transport, size: int, n: int, on_done=None) -> float:
    from npu_agent.sender import Sender

    recs = _records(size, n + 1)
    # the Sender right after the transport, as the debugger does (it must hear the transport's first connect)
    sender = Sender(make_transport(), budget_bytes=SENDER_BUDGET)
    sender.submit(recs[0])   # warm-up: connecting (and the TLS handshake) is not what is measured
    while sender.counts.acknowledged < 1:
        time.sleep(0.001)
    _start()
    for r in recs[1:]:
        sender.submit(r)
    # the agent's threads' CPU, read once every record is acknowledged and before close() ends those threads (a thread
    # that ended is no longer in /proc); the 2 ms polls end within 2 ms of the last acknowledgement
    deadline = time.monotonic() + 600
    while sender.counts.acknowledged < n + 1 and sender.refusal is None and time.monotonic() < deadline:
        time.sleep(0.002)
    _RUN["agent"] = agent_threads_since(_RUN["threads"])
    counts = sender.close(timeout=600)
    if on_done is not None:
        on_done()
    dt = _stop()
    if counts["acknowledged"] != n + 1:
        raise RuntimeError(f"only {counts['acknowledged']} of {n + 1} records acknowledged: {counts}")
    return dt


def bench_ours_grpc(size: int, n: int, tls_dir: str = "") -> float:
    from npu_agent.config import Endpoint
    from npu_agent.transport_grpc import GrpcTransport

    child = Child("tls" if tls_dir else "ours", tls_dir=tls_dir)
    try:
        return run_ours(lambda: GrpcTransport(Endpoint("127.0.0.1", child.port), tls_dir, f"bench{size}", 0, 1),
                        size, n)
    finally:
        child.close()


def bench_ours_unbatched(size: int, n: int) -> float:
    """ours (gRPC) with the sender's batching of small records turned off: each record its own message."""
    from npu_agent import sender

    keep = sender.BATCH_RECORDS
    sender.BATCH_RECORDS = 1
    try:
        return bench_ours_grpc(size, n)
    finally:
        sender.BATCH_RECORDS = keep


def bench_ours_folder(size: int, n: int) -> float:
    from npu_agent.transport_folder import FolderTransport

    with tempfile.TemporaryDirectory(prefix="bench-nfs-") as nfs:
        child = Child("folder", nfs=nfs)
        try:
            return run_ours(lambda: FolderTransport(nfs, f"bench{size}", 0, 1), size, n,
                            on_done=lambda: child.wait_line("END"))
        finally:
            child.close()


def _payload(size: int):
    import torch

    return memoryview(torch.randn(size // 4, dtype=torch.float32).view(torch.uint8).numpy()).cast("B")


def _raw_channel(port: int, client_tls: str = ""):
    """A channel to a bare stream's receiving child on loopback, without message size limits; over mutual TLS with
    the client's certificate folder `client_tls` when given."""
    import grpc

    if client_tls:
        from protos import tls

        return grpc.secure_channel(f"127.0.0.1:{port}", tls.client_credentials(client_tls), options=UNLIMITED)
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=UNLIMITED)


def bench_raw_grpc(size: int, n: int, client_tls: str = "", server_tls: str = "") -> float:
    """The bare stream; over mutual TLS when given the client's and the server's certificate folders."""
    import grpc

    child = Child("rawtls" if client_tls else "rawgrpc", tls_dir=server_tls)
    data = _payload(size)
    pieces = [bytes(data[i:i + RAW_CHUNK]) for i in range(0, size, RAW_CHUNK)]
    channel = _raw_channel(child.port, client_tls)
    try:
        with channel as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            push = ch.stream_unary(RAW_METHOD, request_serializer=None, response_deserializer=None)
            push(iter(pieces))   # warm-up, as for ours
            _start()
            got = push(p for _ in range(n) for p in pieces)
            dt = _stop()
        if int.from_bytes(got, "little") != size * n:
            raise RuntimeError("raw gRPC: bytes lost")
        return dt
    finally:
        child.close()


def bench_raw_bidi(size: int, n: int) -> float:
    """The bare bidirectional stream (module docstring): a fresh copy of the tensor's bytes for each message, every
    answer read by the calling thread (ours reads its acknowledgements on a thread of its own too)."""
    import grpc

    child = Child("rawbidi")
    data = _payload(size)
    cuts = [(i, min(size, i + RAW_CHUNK)) for i in range(0, size, RAW_CHUNK)]

    def messages(records: int):
        for _ in range(records):
            for a, b in cuts:
                yield bytes(data[a:b])   # copied now, from the tensor's memory

    try:
        with _raw_channel(child.port) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            call = ch.stream_stream(BIDI_METHOD, request_serializer=None, response_deserializer=None)
            for _ in call(messages(1)):   # warm-up, as for ours
                pass
            _start()
            answers, last = 0, b""
            for answer in call(messages(n)):
                answers, last = answers + 1, answer
            dt = _stop()
        if answers != n * len(cuts) or int.from_bytes(last, "little") != size * n:
            raise RuntimeError(f"raw bidi: {answers} answers, the last for {int.from_bytes(last, 'little')} bytes, "
                               f"of {n * len(cuts)} messages and {size * n} bytes")
        return dt
    finally:
        child.close()


def bench_raw_tcp(size: int, n: int) -> float:
    child = Child("tcp")
    data = _payload(size)
    try:
        with socket.create_connection(("127.0.0.1", child.port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _start()
            s.sendall((size * n).to_bytes(8, "little"))
            for _ in range(n):
                for i in range(0, size, RAW_CHUNK):
                    s.sendall(data[i:i + RAW_CHUNK])
            if s.recv(1) != b"k":
                raise RuntimeError("raw TCP: no final ack")
            return _stop()
    finally:
        child.close()


def make_pki(folder: str) -> str:
    subprocess.run([sys.executable, os.path.join(ROOT, "certs", "make_certs.py"), "--out", folder, "--server-name",
                    "127.0.0.1", "--client", "bench"], check=True, capture_output=True)
    return folder


ROWS = {   # --rows key -> (label, function, needs the certificates)
    "ours": ("ours (gRPC)", "bench_ours_grpc", False),
    "one": ("one a message", "bench_ours_unbatched", False),
    "tls": ("ours (mTLS)", "bench_ours_grpc_tls", True),
    "folder": ("ours (folder)", "bench_ours_folder", False),
    "raw": ("raw gRPC", "bench_raw_grpc", False),
    "rawtls": ("raw mTLS", "bench_raw_grpc", True),
    "tcp": ("raw TCP", "bench_raw_tcp", False),
    "bidi": ("raw bidi", "bench_raw_bidi", False),
}
BASELINE_ROWS = ("ours", "tls")   # what --baseline measures with the other checkout


def _size(text: str) -> int:
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = {"k": 1024, "m": MiB}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


def _label(size: int) -> str:
    return f"{size // 1024} KiB" if size < MiB else f"{size // MiB} MiB"


def _print_row(size: int, name: str, n: int, dt: float, client: float, server: float) -> None:
    print(f"{_label(size):>8} {name:<14} {size * n / dt / 1e6:9.0f} {n / dt:10.0f} {dt:7.2f} "
          f"{client / n * 1e6:17.1f} {server / n * 1e6:19.1f}", flush=True)


def _baseline(root: str, size: int, mib: float, quick: bool) -> dict:
    """The BASELINE_ROWS measured once with the checkout at `root` (this file, run with its code): label ->
    (records, seconds, sender CPU seconds, receiver CPU seconds)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--root", root, "--sizes", str(size), "--rows",
           ",".join(BASELINE_ROWS), "--emit", "--repeat", "1"] + (["--mib", str(mib)] if mib else []) + \
        (["--quick"] if quick else []) + (["--rtt-ms", str(RTT_S * 1e3)] if RTT_S else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root))
    rows = {}
    for line in out.stdout.splitlines():
        if line.startswith("ROW "):
            _, key, n, dt, client, server = line.split()
            label = "before " + ROWS[key][0].split(" ", 1)[1]
            rows[label] = (int(n), float(dt), float(client), float(server))
    if not rows:
        raise RuntimeError(f"the baseline at {root} failed: {out.stderr[-2000:]}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: ~32 MiB per size")
    p.add_argument("--mib", type=float, default=None, help="MiB sent per size and transport (default 256)")
    p.add_argument("--sizes", default="4k,64k,1m,16m", help="tensor sizes measured (default 4k,64k,1m,16m)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"transports measured (default all: {','.join(ROWS)})")
    p.add_argument("--repeat", type=int, default=3, help="runs of every row per size, alternating between the rows; "
                   "each row's fastest is printed (default 3)")
    p.add_argument("--baseline", default="", help="another checkout (a folder with npu_agent/ and gpu_server/): "
                   "also measure its agent and server (ours, mTLS) in the same run, printed as 'before' rows")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="a network's round trip between sender and receiver: "
                   "every gRPC and TCP row through a relay that holds each byte half of it each way "
                   "(bench/delay_relay.py; the folder row is not delayed)")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--tls", default="", help=argparse.SUPPRESS)
    p.add_argument("--nfs", default="", help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    p.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)   # machine-readable rows (--baseline)
    ns = p.parse_args(argv)
    if ns.serve:
        serve(ns.serve, ns.tls, ns.nfs)
        return 0
    import logging

    logging.basicConfig(level=logging.ERROR)
    try:   # the sending side's thresholds, as the agent sets them in a training's process (the module docstring)
        from npu_agent import freed_memory
    except ImportError:   # (a --baseline checkout from before it)
        pass
    else:
        freed_memory.keep_for_held(SENDER_BUDGET)
    global RTT_S
    RTT_S = ns.rtt_ms / 1e3
    total = (ns.mib or (32 if ns.quick else 256)) * MiB
    sizes = [_size(t) for t in ns.sizes.split(",") if t.strip()]
    keys = [k.strip() for k in ns.rows.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        p.error(f"unknown --rows {unknown}; choose from {','.join(ROWS)}")
    if not ns.emit:
        print(f"transport throughput on loopback{f' with a round trip of {ns.rtt_ms:g} ms' if RTT_S else ''}, "
              f"{total / MiB:.0f} MiB per size and transport, the fastest of "
              f"{ns.repeat} runs of each (the rows alternating); receiver in another process; CPUs: {os.cpu_count()}"
              + (f"; 'before': {ns.baseline}" if ns.baseline else ""))
    with tempfile.TemporaryDirectory(prefix="bench-pki-") as tmp:
        pki = make_pki(os.path.join(tmp, "pki"))
        client_tls, server_tls = os.path.join(pki, "clients", "bench"), os.path.join(pki, "server")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        header = (f"{'tensor':>8} {'transport':<14} {'MB/s':>9} {'records/s':>10} {'s':>7} "
                  f"{'sender CPU us/rec':>17} {'receiver CPU us/rec':>19}")
        if not ns.emit:
            print(header)
            print("-" * len(header))
        for size in sizes:
            n = (5000 if ns.quick else 20000) if size <= SMALL else max(4, int(total // size))
            best: dict[str, tuple[int, float, float, float]] = {}   # label -> the fastest run's numbers
            threads: dict[str, dict[str, float]] = {}   # label -> the agent's threads' CPU in that run (ours)
            for _ in range(max(1, ns.repeat)):   # other work on the machine only adds time: the fastest counts
                if ns.baseline:
                    for label, row in _baseline(os.path.abspath(ns.baseline), size, ns.mib, ns.quick).items():
                        _keep(best, label, row)
                for key in keys:
                    name, fn, tls = ROWS[key]
                    dt = globals()[fn](size, n, *((client_tls, server_tls) if tls else ()))
                    if ns.emit:
                        print(f"ROW {key} {n} {dt} {_RUN['client']} {_RUN['server']}", flush=True)
                    elif _keep(best, name, (n, dt, _RUN["client"], _RUN["server"])):
                        threads[name] = _RUN["threads"]
            if not ns.emit:
                for label, row in best.items():
                    _print_row(size, label, *row)
                for label, seconds in threads.items():
                    if label.startswith("ours") or label == "one a message":   # (a bare stream has no agent)
                        print(f"{'':>8} {label}: the sending process's threads, CPU a record: "
                              f"{agent_threads_line(seconds, best[label][0])}", flush=True)
                _print_ratios({label: row[1] for label, row in best.items()})
                short = min(row[1] for row in best.values())
                if short < SHORT_ROW_S and size > SMALL:   # (small records: a fixed count, whatever --mib)
                    print(f"{'':>8} (a row took {short:.2f} s: rows this short vary from run to run more than the "
                          f"goal's margin; --mib {_steadier_mib(n * size, short):g} makes them last "
                          f"{SHORT_ROW_S:g} s or more)", flush=True)
    return 0


def _steadier_mib(moved: int, seconds: float) -> float:
    """The --mib (a power of two) whose rows would last SHORT_ROW_S or more at the pace of a row that moved `moved`
    bytes in `seconds`."""
    mib = 1.0
    while mib * MiB < moved * SHORT_ROW_S / max(seconds, 1e-9):
        mib *= 2
    return mib


def _keep(best: dict, label: str, row: tuple[int, float, float, float]) -> bool:
    """Remember `row` (records, seconds, sender and receiver CPU) for `label` when it is its fastest run so far
    (True then)."""
    if label not in best or row[1] < best[label][1]:
        best[label] = row
        return True
    return False


def _print_ratios(rows: dict) -> None:
    """The ratios whose rows were measured (faster is larger: the other's seconds over these)."""
    pairs = [("ours/raw gRPC", "ours (gRPC)", "raw gRPC"), ("before/raw gRPC", "before (gRPC)", "raw gRPC"),
             ("ours (mTLS)/raw mTLS", "ours (mTLS)", "raw mTLS"),
             ("before (mTLS)/raw mTLS", "before (mTLS)", "raw mTLS"),
             ("after/before", "ours (gRPC)", "before (gRPC)"), ("after/before (mTLS)", "ours (mTLS)", "before (mTLS)"),
             ("mTLS/raw gRPC", "ours (mTLS)", "raw gRPC"), ("ours/raw TCP", "ours (gRPC)", "raw TCP"),
             ("ours/raw bidi", "ours (gRPC)", "raw bidi"), ("raw bidi/raw gRPC", "raw bidi", "raw gRPC"),
             ("batched/one a message", "ours (gRPC)", "one a message"), ("folder/ours", "ours (folder)", "ours (gRPC)")]
    parts = [f"{label} {rows[other] / rows[mine]:.2f}" for label, mine, other in pairs
             if mine in rows and other in rows]
    if parts:
        print(f"{'':>8} ratios: " + ", ".join(parts), flush=True)


def bench_ours_grpc_tls(size: int, n: int, client_tls: str, server_tls: str) -> float:
    from npu_agent.config import Endpoint
    from npu_agent.transport_grpc import GrpcTransport

    child = Child("tls", tls_dir=server_tls)
    try:
        return run_ours(lambda: GrpcTransport(Endpoint("127.0.0.1", child.port), client_tls, f"bench{size}", 0, 1),
                        size, n)
    finally:
        child.close()


if __name__ == "__main__":
    sys.exit(main())
