"""`gpu-server --config server.json --out ./results`: the benchmark host's command (docs/design.md §6.1).

msprobe's spellings `-config` and `-o` work too. SIGINT/SIGTERM: stop accepting, check everything already accepted,
flush the reports, print the summary, exit 0 (1 with `--fail-on error` when an API failed; 3 when report rows
could not be written: those records stay in the spool for a restart).

Every acknowledged record is in `--out/spool/` until its rows are written; a restart with the same `--out` (after a
crash, a kill or a stop) resumes: same report files, spooled records checked first, nothing written twice
(gpu_server/spool/store.py). Use a new `--out` for a new session. `--keep-records` moves reported records into
`--out/spool/kept/` instead of deleting them, so that `gpu-server recheck OUT` can check the whole run again.
`--extensions FILE` (or run_ut.extensions) loads the operator's extension file at start (docs/extensions.md); a
file with problems is refused with one line per problem and exit status 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from gpu_server import malloc_policy, omp_wait
from gpu_server.config import ServerConfig, ServerConfigError, load_server_config
from gpu_server.replay import prestart
from gpu_server.stop_signal import StopSignal
from protos.limits import DEFAULT_LIMITS, MiB
from protos.net import is_loopback

log = logging.getLogger("gpu_server")
SUBCOMMANDS = ("health", "report", "compare", "recheck", "summary")


def _args(argv):
    p = argparse.ArgumentParser(prog="gpu-server", description="Online accuracy checker: the benchmark-host server.")
    p.add_argument("--config", "-config", required=True, help="msprobe run_ut config.json (task run_ut)")
    p.add_argument("--out", "-o", "--out_path", default="./", help="folder for the reports (created if missing)")
    p.add_argument("--device", "-d", default=None, help="cpu, cuda or cuda:N (default: every GPU, else CPU)")
    p.add_argument("--workers", type=int, default=None, help="CPU worker threads (default 1; GPUs: one each)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks of the training: records and ends of a rank at or above it are refused; with "
                        "--exit-when-done, the ranks to wait for")
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit once every expected rank has sent its end message (needs --world-size or rank_list)")
    p.add_argument("--fail-on", choices=("never", "error"), default="never",
                   help="'error': exit status 1 when any API failed (for CI)")
    p.add_argument("--backward-memory-mb", type=float, default=4096,
                   help="memory for forward inputs kept until their backward check (default 4096)")
    p.add_argument("--graph-memory-mb", type=float, default=2048,
                   help="per worker: memory for the forward replays' autograd graphs kept until their backward "
                        "record (default 2048; on a GPU bench, device memory); 0 replays each forward again instead")
    p.add_argument("--max-record-mb", type=float, default=None,
                   help="largest record accepted (default: half of --memory-mb; at most --memory-mb): a larger one "
                        "is refused at its header with a message naming these options")
    p.add_argument("--memory-mb", type=float, default=None,
                   help="memory for what the server holds at once: messages and records as they arrive, each "
                        "complete record at its estimated check peak until it is checked (docs/security.md, "
                        "'Memory'; default: a quarter of the host's memory, at least 1024); a full budget slows the "
                        "agents down")
    p.add_argument("--error-data-max-mb", type=float, default=None,
                   help="cap on the evidence saved under error_data_path per session (default: 1024, or a quarter of "
                        "the disk space free at the start when that is less); past it, failing calls are still "
                        "reported, only their tensors are not saved; 0 saves none")
    p.add_argument("--max-streams", type=int, default=DEFAULT_LIMITS.max_streams,
                   help=f"agent streams served at once (default {DEFAULT_LIMITS.max_streams}); one more is refused "
                        "with a message the agent logs")
    # what a client may hold, and for how long (docs/security.md, "Who can reach the port or the folder")
    p.add_argument("--record-timeout-s", type=float, default=DEFAULT_LIMITS.record_timeout_s,
                   help="a record half received is cut (its stream closed, its memory released) when its next frame "
                        f"takes longer (default {DEFAULT_LIMITS.record_timeout_s:g})")
    p.add_argument("--min-record-rate-mb", type=float, default=DEFAULT_LIMITS.min_record_rate / MiB, metavar="MB_S",
                   help="... or when, after --record-timeout-s, it arrives slower than this many MiB/s on average "
                        f"(default {DEFAULT_LIMITS.min_record_rate / MiB:g}; time spent waiting for the server's "
                        "memory is not counted; 0: no minimum)")
    p.add_argument("--record-max-s", type=float, default=DEFAULT_LIMITS.record_max_s,
                   help="... or when it has been half received this long, whatever its size (default "
                        f"{DEFAULT_LIMITS.record_max_s:g})")
    p.add_argument("--connection-memory-mb", type=float, default=None,
                   help="what the streams of one connection may hold before the workers take it (messages, records "
                        "half received); at the limit only its oldest half-received record is read on (default: "
                        "--max-record-mb, at least that, at most --memory-mb)")
    p.add_argument("--max-run-ranks", type=int, default=DEFAULT_LIMITS.max_run_ranks,
                   help="distinct (run id, rank) pairs this server accepts records of; the records of one more are "
                        f"refused with the reason (default {DEFAULT_LIMITS.max_run_ranks}). With --world-size, ranks "
                        "at or above it are refused too")
    p.add_argument("--collective-memory-mb", type=float, default=1024,
                   help="what the collective records waiting for the records of their other ranks may hold (default "
                        "1024); beyond it the oldest incomplete collective is decided at once (its records reported "
                        "'evicted', naming this option)")
    p.add_argument("--keep-records", action="store_true",
                   help="keep every record after it is reported (in OUT/spool/kept/, for `gpu-server recheck`) "
                        "instead of deleting it; costs as much disk as the training sends (off by default)")
    p.add_argument("--replay-in", choices=("process", "thread"), default="process",
                   help="where replays run: 'process' (default) in a long-lived worker process per worker, capped by "
                        "--replay-memory-mb and --replay-timeout-s, replaced when a replay kills it; 'thread' in the "
                        "server process itself (no caps: only for records you trust, and for measuring the difference)")
    p.add_argument("--replay-memory-mb", type=float, default=None,
                   help="per replay worker process: memory one replay may use beyond the worker's start-up size "
                        "(default: an eighth of the host's memory, at least 2048); a replay that needs more is "
                        "reported SKIP naming this option")
    p.add_argument("--replay-timeout-s", type=float, default=120.0,
                   help="the longest one replay may run (default 120); a longer one is stopped, its worker replaced, "
                        "its record quarantined and reported SKIP naming this option")
    p.add_argument("--bias-fail-ulp", type=float, default=None, metavar="X",
                   help="judging across calls (docs/pooled.md): a bias of an API pooled over the run that is "
                        "statistically significant is an error above X ULP of the device dtype, a finding below "
                        "(default 0.005)")
    p.add_argument("--extensions", default=None, metavar="FILE",
                   help="the extension file (TOML, docs/extensions.md): references of custom and fused operators, "
                        "post-processing of outputs, per-API judging; trusted code, writable by its owner only "
                        "(docs/security.md). Wins over run_ut.extensions in --config")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:   # offline tools and the health probe (gpu_server/tools/offline.py)
        from gpu_server.tools.offline import run_subcommand

        return run_subcommand(argv[0], argv[1:])
    logging.basicConfig(level=logging.INFO, format="[gpu-server] %(levelname)s %(message)s", stream=sys.stderr)
    ns = _args(argv)
    malloc_policy.keep_freed_memory()   # (the replay workers do the same at their start)
    omp_wait.passive(os.environ)   # before torch loads libgomp; the replay workers inherit it (gpu_server/omp_wait.py)
    try:
        config = load_server_config(ns.config)
    except ServerConfigError as exc:
        print(f"gpu-server: {exc}", file=sys.stderr)
        return 2
    if ns.replay_in == "process" and (ns.workers or 1) > 0:
        # the fork server loads the meta kernels (or the workers' interpreters import torch) while this process goes
        # on with its start (gpu_server/replay/prestart.py)
        prestart.start(ns.workers or 1, fork=True)   # (this process has run no torch operation, and no thread)
    try:
        return _serve(ns, config)
    finally:
        prestart.stop()   # the fork server, if any (its workers ended with the server's workers)


def _serve(ns: argparse.Namespace, config: ServerConfig) -> int:
    """The rest of `main`, once the replay workers are on their way: the options that need torch, the server, its
    progress lines, its drain and its reports."""
    from gpu_server.app import ServerApp, default_memory_budget  # imports torch: after the cheap checks
    from gpu_server.spool.store import SpoolError

    if ns.error_data_max_mb is not None and ns.error_data_max_mb < 0:
        print("gpu-server: --error-data-max-mb must be 0 or more", file=sys.stderr)
        return 2
    try:
        os.makedirs(ns.out, exist_ok=True)
        if not os.access(ns.out, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable by this user")
    except OSError as exc:
        print(f"gpu-server: --out {ns.out}: cannot create or write this folder ({exc.strerror or exc}); choose a "
              "folder this user may write", file=sys.stderr)
        return 2
    memory = int(ns.memory_mb * MiB) if ns.memory_mb else default_memory_budget()
    max_record = int(ns.max_record_mb * MiB) if ns.max_record_mb else memory // 2
    if max_record > memory:
        print(f"gpu-server: --max-record-mb {max_record / MiB:g} is more than the memory budget ({memory / MiB:g} "
              "MiB, --memory-mb): such a record could not be held; raise --memory-mb or lower --max-record-mb",
              file=sys.stderr)
        return 2
    if ns.bias_fail_ulp is not None and not ns.bias_fail_ulp >= 0:
        print("gpu-server: --bias-fail-ulp must be 0 or more (ULP of the device dtype)", file=sys.stderr)
        return 2
    if ns.replay_timeout_s <= 0 or (ns.replay_memory_mb is not None and ns.replay_memory_mb <= 0):
        print("gpu-server: --replay-timeout-s and --replay-memory-mb must be positive", file=sys.stderr)
        return 2
    if ns.max_streams < 1 or ns.record_timeout_s <= 0 or ns.record_max_s <= 0 or ns.min_record_rate_mb < 0:
        print("gpu-server: --max-streams must be at least 1, --record-timeout-s and --record-max-s positive, "
              "--min-record-rate-mb 0 or more", file=sys.stderr)
        return 2
    if ns.max_run_ranks < 1 or (ns.world_size is not None and ns.world_size < 1):
        print("gpu-server: --max-run-ranks and --world-size must be positive", file=sys.stderr)
        return 2
    if ns.connection_memory_mb is not None and not max_record <= ns.connection_memory_mb * MiB <= memory:
        print(f"gpu-server: --connection-memory-mb must lie between the largest record ({max_record / MiB:g} MiB, "
              f"--max-record-mb) and the memory budget ({memory / MiB:g} MiB, --memory-mb): a record larger than it "
              "could never be received", file=sys.stderr)
        return 2
    limits = DEFAULT_LIMITS.replace(max_record_bytes=max_record, max_streams=ns.max_streams,
                                    record_timeout_s=ns.record_timeout_s, record_max_s=ns.record_max_s,
                                    min_record_rate=ns.min_record_rate_mb * MiB, max_run_ranks=ns.max_run_ranks,
                                    max_connection_bytes=int((ns.connection_memory_mb or 0) * MiB))
    expected = ns.world_size or (len(config.rank_list) if config.rank_list else None)
    if ns.exit_when_done and not expected:
        print("gpu-server: --exit-when-done needs --world-size N (or a non-empty rank_list)", file=sys.stderr)
        return 2
    # Installed before the server starts (start-up may replay a spool; the port may be open already): a SIGTERM
    # from then on drains what was accepted, never kills the process with records half-reported. The handler takes
    # no lock (gpu_server/stop_signal.py).
    stop = StopSignal().install(signal.SIGTERM, signal.SIGINT)
    try:
        app = ServerApp(config, ns.out, device=ns.device, workers=ns.workers, limits=limits,
                        backward_budget=int(ns.backward_memory_mb * MiB),
                        expected_ranks=expected if ns.exit_when_done else None,
                        memory_budget=memory,
                        error_data_max_bytes=None if ns.error_data_max_mb is None else int(ns.error_data_max_mb * MiB),
                        keep_records=ns.keep_records, graph_budget=int(max(0.0, ns.graph_memory_mb) * MiB),
                        replay_in=ns.replay_in, replay_timeout_s=ns.replay_timeout_s,
                        replay_memory=None if ns.replay_memory_mb is None else int(ns.replay_memory_mb * MiB),
                        world_size=ns.world_size, collective_budget=int(max(0.0, ns.collective_memory_mb) * MiB),
                        extensions=ns.extensions or config.extensions or None,
                        **({} if ns.bias_fail_ulp is None else {"bias_fail_ulp": ns.bias_fail_ulp}))
        app.start()
    except (ValueError, OSError, SpoolError) as exc:
        print(f"gpu-server: {exc}", file=sys.stderr)
        return 2
    finally:
        prestart.discard()   # those no worker took (fewer workers, or none in a process)
    if config.nfs_path:
        log.info("watching shared folder %s; reports in %s", config.nfs_path, os.path.abspath(ns.out))
    else:
        if not config.tls_path and not is_loopback(config.host):
            log.warning("serving plaintext on %s: training data crosses the network unencrypted; set run_ut.tls_path "
                        "for mutual TLS (certs/README.md)", config.host)
        log.info("listening on %s (%s); reports in %s", app.bind_target, "mutual TLS" if config.tls_path else
                 "plaintext", os.path.abspath(ns.out))
    tty = sys.stderr.isatty()
    last = ""
    while not stop.is_set() and not app.done.is_set():
        stop.wait(0.5 if tty else 2.0)
        line = app.summary.progress_line()
        if not ns.quiet and line != last:
            print(("\r" + line) if tty else f"[gpu-server] {line}", end="" if tty else "\n", file=sys.stderr,
                  flush=True)
            last = line
    if tty and not ns.quiet:
        print(file=sys.stderr)
    if stop.is_set():
        log.info("%s: draining what was accepted, then exiting", stop.name)
    t0 = time.time()
    app.shutdown()
    paths = app.finish()
    print(app.summary.human())
    print(f"reports ({time.time() - t0:.1f} s to drain):")
    for p in paths:
        print(f"  {p}")
    unwritten = sum(app.summary.report_failures.values())
    if unwritten:
        print(f"gpu-server: the report rows of {unwritten} records could not be written (see the log); they are kept "
              f"in {os.path.join(os.path.abspath(ns.out), 'spool')}: fix the cause and restart with the same --out",
              file=sys.stderr)
        return 3
    return 1 if ns.fail_on == "error" and app.summary.failed_run() else 0


if __name__ == "__main__":
    sys.exit(main())
