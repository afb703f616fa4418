"""`gpu-server` sub-commands that work on what a server wrote, without a training:

    gpu-server report OUT [-o FILE]                       the HTML report (gpu_server/reports/html.py)
    gpu-server summary OUT [--json] [--fail-on error]     the console summary again, from the CSV reports
    gpu-server compare -npu DETAILS.csv -gpu DETAILS.csv -o DIR
                                                          msprobe's api_precision_compare on two machines' files
    gpu-server recheck OUT [--device cuda] [--config server.json] [--extensions FILE]
                                                          check the records in OUT's spool again, into a new folder
    gpu-server health --host H --port P [--tls-path DIR]  the gRPC health probe (gpu_server/tools/health.py)

Exit status: 0 done, 1 failures found where `--fail-on error` asks, 2 bad input: one line on stderr naming the file
and saying what to do, never a traceback.

Every file these tools read is opened as gpu_server/safe_open.py does: a regular file only (a FIFO, a socket, a
device or a folder named like a report is refused at once, never waited on), never through a symbolic link found in
a folder (a path named on the command line, `compare -npu FILE` or `recheck --config FILE`, may be a link: it is
resolved once), its content checked (UTF-8, the CSV header and every row's length, a file cut short, valid JSON of
the types a server writes). A report, summary JSON or spool segment that fails is refused with exit status 2; a
spool segment that is a link or not a regular file is left out of a recheck (said on stderr).

`recheck` checks the records the spool holds: those not yet completely reported (a crashed or killed server) and,
for a server started with `--keep-records`, every reported one (moved into `spool/kept/` instead of deleted). Without
`--keep-records` a cleanly drained spool is empty and there is nothing to check again. `--extensions FILE` (or the
config's run_ut.extensions) rechecks with an extension file (docs/extensions.md): its references, post-processing
and per-API judging; a file with problems is refused before anything is copied, one line per problem, exit status 2.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import io
import json
import logging
import os
import stat
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from gpu_server.reports import files as report_files
from gpu_server.safe_open import FileRefused, create_regular, csv_rows, open_regular, read_json
from gpu_server.statuses import aggregate

if TYPE_CHECKING:
    import torch

    from gpu_server.config import ServerConfig
    from gpu_server.judging.metrics import OutputMetrics
    from gpu_server.reports.summary import Summary

log = logging.getLogger("gpu_server")

_MAX_MESSAGE = 600      # characters of an error message printed (a path and a reason; the rest is noise)


def _one_line(text: str) -> str:
    """A multi-line message (a config's list of problems) as one line: its lines joined by '; '."""
    line = ""
    for part in (p.strip() for p in str(text).splitlines()):
        if part:
            line += (" " if line.endswith(":") else "; " if line else "") + part
    return line if len(line) <= _MAX_MESSAGE else line[:_MAX_MESSAGE] + "..."


def run_subcommand(name: str, argv: list[str]) -> int:
    """Run one sub-command; any failure is one line on stderr and exit status 2 (GPU_SERVER_TRACEBACK=1: the
    traceback of an unexpected one, for a bug report)."""
    handlers: dict[str, Callable[[list[str]], int]] = {
        "health": _health, "report": report_main, "summary": summary_main, "compare": compare_main,
        "recheck": recheck_main}
    try:
        return handlers[name](argv)
    except (ValueError, OSError) as exc:      # FileRefused and the other refusals name the file and what to do
        if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
            text = f"{exc.filename}: {exc.strerror}"
        else:
            text = str(exc) or type(exc).__name__
        print(f"gpu-server {name}: {_one_line(text)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a malformed input this code did not foresee: still one line
        if os.environ.get("GPU_SERVER_TRACEBACK"):
            raise
        print(f"gpu-server {name}: cannot finish ({type(exc).__name__}: {_one_line(str(exc))[:300]}); an input "
              "file is probably malformed (GPU_SERVER_TRACEBACK=1 shows where)", file=sys.stderr)
        return 2


def _health(argv: list[str]) -> int:
    from gpu_server.tools.health import main

    return main(argv)


def _out_dir(path: str) -> str:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such folder (give the --out folder of a gpu-server run)")
    return path


# -- report ----------------------------------------------------------------------------------------------------
def report_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gpu-server report", description="Write the self-contained HTML report of a "
                                "--out folder (next to its CSV files unless -o is given).")
    p.add_argument("out", help="the server's --out folder")
    p.add_argument("-o", "--output", default=None, help="HTML file to write (default OUT/report_{ts}.html)")
    ns = p.parse_args(argv)
    from gpu_server.reports.html import write_html

    out = _out_dir(ns.out)
    pattern = report_files.rank_glob(report_files.PRECISION_RESULT)
    if not glob.glob(os.path.join(glob.escape(out), pattern)):
        raise FileNotFoundError(f"{out}: no {pattern} reports in it")
    if ns.output is not None:
        _check_output(ns.output)
    print(write_html(out, ns.output))
    return 0


def _check_output(path: str) -> None:
    """The HTML file is written whole (`path + ".tmp"`, then renamed over `path`): a link or a FIFO left at the
    temporary name would be written through or waited on; refused instead."""
    tmp = path + ".tmp"
    try:
        mode = os.lstat(tmp).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise FileRefused(tmp, "exists and is not a regular file (a link, a FIFO, ...): remove it, or choose "
                               "another -o")


# -- summary ---------------------------------------------------------------------------------------------------
def summarize(out_dir: str) -> Summary:
    """A gpu_server.reports.summary.Summary rebuilt from the CSV reports of every session in `out_dir`, with the end and
    transport counts of the sessions' summary_{ts}.json files where they exist."""
    from gpu_server.reports.frame import report_files as frame_files
    from gpu_server.reports.summary import Summary

    summary = Summary()
    sessions = sorted({ts for _, ts, _ in frame_files(out_dir, "result")})
    if not sessions:
        raise FileNotFoundError(f"{out_dir}: no {report_files.rank_glob(report_files.RESULT)} reports in it")
    for ts in sessions:
        summary.seed_from_reports(out_dir, ts, strict=True)
        _reload_summary_json(summary, out_dir, ts)
    _find_evidence(summary, out_dir)
    summary.session = {"sessions": sessions}
    return summary


_MOVE_SUMMARY = "; move it out of the folder to summarize from the CSV reports alone"


def _reload_summary_json(summary: Summary, out_dir: str, ts: str) -> None:
    """The end and transport counts, the pooled findings and the inf/NaN origins a session's summary_{ts}.json
    saved (none: nothing to add). One that is not a regular file, not JSON, or holds values of types a server does
    not write is refused (FileRefused): its values are first applied to a scratch summary, printed both ways."""
    from gpu_server.reports import files as names
    from gpu_server.reports.summary import Summary

    path = names.summary_path(out_dir, ts)
    try:
        saved = read_json(path, "summary JSON")
    except FileRefused as exc:
        if exc.missing:
            return
        raise FileRefused(exc.path, exc.why + _MOVE_SUMMARY) from None
    try:
        if not isinstance(saved, dict):
            raise TypeError(f"a JSON {type(saved).__name__}, not the object a server writes")
        scratch = Summary()
        _apply_saved(scratch, saved)
        scratch.human()
        scratch.failed_run()
        json.dumps(scratch.as_dict())
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as exc:
        raise FileRefused(path, f"holds values a server does not write ({type(exc).__name__}: "
                                f"{_one_line(str(exc))[:120]})" + _MOVE_SUMMARY) from None
    _apply_saved(summary, saved)


def _apply_saved(summary: Summary, saved: dict[str, Any]) -> None:
    from gpu_server.reports.summary import SavedFindings

    for rank, n in saved.get("records_received", {}).items():
        summary.received[int(rank)] += int(n)
    for end in saved.get("ranks_ended", []):
        counts = {k: v for k, v in end.items() if k not in ("run_id", "rank")}
        summary.rank_ended(str(end.get("run_id", "")), int(end.get("rank", 0)), counts)
    for key, n in saved.get("transport", {}).items():
        summary.count(str(key), int(n))
    if isinstance(saved.get("api_bias"), dict):   # the pooled test needs every element: kept from the run
        summary.pooled = SavedFindings(saved["api_bias"])  # type: ignore[assignment]  # Summary.pooled: untyped
    _reload_nonfinite(summary, saved.get("nonfinite"))


def _find_evidence(summary: Summary, out_dir: str) -> None:
    """The error-data folder of each rank's first failing call, where the server saved it inside `out_dir` (a
    relative error_data_path, msprobe's default)."""
    for rank, e in list(summary.first_anomaly.items()):
        pattern = os.path.join(glob.escape(out_dir), "error_data", "*", "*", f"rank{int(rank)}",
                               glob.escape(f"{e['call']}.step{int(e['step'])}"))
        found = sorted(p for p in glob.glob(pattern) if os.path.isdir(p) and not os.path.islink(p))
        if found:
            summary.evidence_saved(rank, e["call"], e["step"], found[-1])


def _reload_nonfinite(summary: Summary, saved: Any) -> None:
    """The origins of inf/NaN a session's summary JSON saved (they need the tensors: the CSVs do not have them)."""
    by_rank = saved.get("by_rank") if isinstance(saved, dict) else None
    for rank, entries in (by_rank if isinstance(by_rank, dict) else {}).items():
        for kind, inputs_finite in (("origin", True), ("first_input", False)):
            e = entries.get(kind) if isinstance(entries, dict) else None
            if not isinstance(e, dict):    # absent, or not what a server wrote
                continue
            try:
                summary.nonfinite(int(rank), int(e["step"]), int(e["seq"]), str(e["call"]), str(e.get("direction", "")),
                                  str(e.get("module", "")), str(e.get("source", "")), inputs_finite,
                                  bool(e.get("device")), bool(e.get("bench")))
            except (TypeError, KeyError, ValueError):   # absent, or not what a server wrote
                continue


def summary_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gpu-server summary", description="The end-of-run summary of a --out folder, "
                                "recomputed from its CSV reports.")
    p.add_argument("out", help="the server's --out folder")
    p.add_argument("--json", action="store_true", help="print JSON (for CI) instead of text")
    p.add_argument("--fail-on", choices=("never", "error"), default="never",
                   help="'error': exit status 1 when any API failed")
    ns = p.parse_args(argv)
    summary = summarize(_out_dir(ns.out))
    if ns.json:
        data = summary.as_dict()
        data.pop("elapsed_s", None)
        print(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        print(summary.human().replace(f" ({summary.as_dict()['elapsed_s']:.1f} s)", "", 1))
    return 1 if ns.fail_on == "error" and summary.failed_run() else 0


# -- compare (msprobe api_precision_compare) -------------------------------------------------------------------
_UNSUPPORTED = {"torch.float64", "torch.complex64", "torch.complex128"}
_TOPK_NOTE = ("在npu上，topk的入参sorted=False时不生效，会返回有序tensor，而cpu上会返回无序tensor。 "
              "如果topk精度不达标，请检查是否是该原因导致的。")


def _metrics(row: dict[str, str]) -> OutputMetrics:
    """gpu_server.judging.metrics.OutputMetrics from one accuracy_checking_details row (blank cells are None)."""
    from gpu_server.columns import METRIC_COLUMNS
    from gpu_server.judging.metrics import OutputMetrics

    values: dict[str, Any] = {}
    for attr, title in METRIC_COLUMNS:
        cell = (row.get(title) or "").strip()
        values[attr] = float(cell) if cell else None
    return OutputMetrics(**values)


def _dtype(text: str) -> torch.dtype | None:
    import torch

    name = text.strip()
    value = getattr(torch, name[len("torch."):], None) if name.startswith("torch.") else None
    return value if isinstance(value, torch.dtype) else None


def _read_details(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """A details file named on the command line (a link is resolved once; gpu_server/safe_open.py), checked."""
    from gpu_server.columns import DETAILS_HEADER

    try:
        return csv_rows(path, "accuracy_checking_details file", [c for c in DETAILS_HEADER if c != "Message"],
                        hint="give an accuracy_checking_details CSV a server wrote", named=True)
    except FileRefused as exc:
        if exc.missing:
            raise FileRefused(path, "no such file (give an accuracy_checking_details CSV)", missing=True) from None
        raise


def judge_pair(npu: dict[str, str], gpu: dict[str, str], call: str) -> tuple[str, dict[str, Any], str, str]:
    """One output row of `call`: (status, cells, algorithm, message) from the NPU row (the device) and the GPU row
    (the reference machine), msprobe's api_precision_compare rule (docs/standards.md)."""
    from gpu_server.judging.standards import STANDARD_REGISTRY, select_standard
    from gpu_server.judging.standards.registry import StandardInput
    from protos.limits import call_api

    dtype_text = (npu.get("DEVICE Dtype") or "").strip()
    if not dtype_text or dtype_text in _UNSUPPORTED or (npu.get("Shape") or "").strip() == "(0,)":
        return "SKIP", {}, " ", (npu.get("Message") or "").strip()
    api_name = call_api(call).partition(".")[2]   # the api without its category
    dtype = _dtype(dtype_text)
    key = select_standard(api_name, dtype)
    standard = STANDARD_REGISTRY[key]
    try:
        result = standard.judge(StandardInput(dtype, _metrics(npu), _metrics(gpu)))
    except (TypeError, ValueError) as exc:
        return "SKIP", {}, standard.algorithm, f"a metric cell is blank or not a number ({exc})"
    cells = {k: v for k, v in result.cells.items() if v is not None}
    return result.status, cells, standard.algorithm, "".join(m if m.endswith("\n") else m + "\n"
                                                             for m in result.messages if m).strip()


def compare(npu_path: str, gpu_path: str, out_dir: str) -> tuple[str, str]:
    """Write api_precision_compare_result_{ts}.csv and api_precision_compare_details_{ts}.csv into out_dir from two
    details files. Rows are matched by API Name (and Step, when both files have it: ours repeat API names per
    step). Returns the two paths."""
    from gpu_server.columns import PRECISION_DETAILS_HEADER, PRECISION_RESULT_HEADER
    from gpu_server.reports.rank_reports import cell, clean

    npu_header, npu_rows = _read_details(npu_path)
    gpu_header, gpu_rows = _read_details(gpu_path)
    with_step = "Step" in npu_header and "Step" in gpu_header
    key = (lambda r: (r["API Name"], r["Step"])) if with_step else (lambda r: (r["API Name"],))
    gpu_by: dict[tuple[str, ...], dict[str, str]] = {}
    for row in gpu_rows:
        k = key(row)
        if k in gpu_by:
            raise ValueError(f"{gpu_path}: API Name {' step '.join(k)} appears twice; each output row must be unique"
                             " (a file per rank and session)")
        gpu_by[k] = row
    os.makedirs(out_dir, exist_ok=True)
    ts = time.strftime("%Y%m%d%H%M%S")
    result_path = report_files.comparison_path(out_dir, report_files.PRECISION_RESULT, ts)
    details_path = report_files.comparison_path(out_dir, report_files.PRECISION_DETAILS, ts)
    extra = ["Step"] if with_step else []
    # (full API, step) -> {"forward": [...], "backward": [...], "skip": msg, "unsupported": bool}
    calls: dict[tuple[str, str], dict[str, Any]] = {}
    missing = 0
    with _create_text(details_path) as dfh, _create_text(result_path) as rfh:
        details, results = csv.writer(dfh), csv.writer(rfh)
        details.writerow(PRECISION_DETAILS_HEADER + extra)
        results.writerow(PRECISION_RESULT_HEADER + extra)
        for row in npu_rows:
            name = row["API Name"]
            parsed = report_files.split_row_name(name)
            step = [row["Step"]] if with_step else []
            if parsed is None:
                message = f"The API name {name} is invalid."
                details.writerow([name] + [" "] * (len(PRECISION_DETAILS_HEADER) - 4) + ["SKIP", " ", message] + step)
                results.writerow([name, "SKIP", "SKIP", message] + step)
                continue
            gpu = gpu_by.get(key(row))
            if gpu is None:
                missing += 1
                log.warning("compare: %s is not in %s; the row is left out", name, gpu_path)
                continue
            call, direction = parsed
            status, cells, algorithm, message = judge_pair(row, gpu, call)
            details.writerow([name] + [cell(cells.get(t)) for t in PRECISION_DETAILS_HEADER[1:-3]]
                             + [status, algorithm or " ", clean(message) or " "] + step)
            entry = calls.setdefault((call, row["Step"] if with_step else ""),
                                     {"forward": [], "backward": [], "skip": "", "unsupported": False})
            if (row.get("DEVICE Dtype") or "").strip() in _UNSUPPORTED:
                entry["unsupported"] = True
                continue
            entry[direction].append(status)
            if status == "SKIP" and direction == "forward":
                entry["skip"] = message
        for (api, api_step), entry in calls.items():
            tail = [api_step] if with_step else []
            fwd, bwd = aggregate(entry["forward"]), aggregate(entry["backward"])
            if entry["unsupported"] and not entry["forward"] and not entry["backward"]:
                results.writerow([api, "SKIP", "SKIP", "This data type does not support benchmark compare."] + tail)
                continue
            message = ""
            if fwd == "error" and api.split(".")[1:2] == ["topk"]:
                message = _TOPK_NOTE
            elif fwd == "SKIP":
                message = entry["skip"]
            results.writerow([api, fwd, bwd, clean(message) or " "] + tail)
    if missing:
        print(f"gpu-server compare: {missing} rows of {npu_path} have no row of the same name in {gpu_path}; "
              "they are left out", file=sys.stderr)
    return result_path, details_path


def _create_text(path: str) -> io.TextIOWrapper:
    """An output CSV (UTF-8 with a BOM, like msprobe's), never written through a link or into a FIFO."""
    return io.TextIOWrapper(create_regular(path), encoding="utf-8-sig", newline="")


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gpu-server compare", description="msprobe's api_precision_compare: judge the "
                                "device's accuracy_checking_details against a reference machine's.")
    p.add_argument("-npu", "--npu_csv_path", dest="npu", required=True, help="details CSV of the device under test")
    p.add_argument("-gpu", "--gpu_csv_path", dest="gpu", required=True, help="details CSV of the reference machine")
    p.add_argument("-o", "--out_path", dest="out", default="./", help="folder for the two output files")
    ns = p.parse_args(argv)
    for path in compare(ns.npu, ns.gpu, ns.out):
        print(path)
    return 0


# -- recheck ---------------------------------------------------------------------------------------------------
def _link_or_copy(src: str, dst: str) -> bool:
    """Put the regular file `src` at `dst`: a hard link when possible, else a copy. A link is never followed (the
    link's own inode is checked after linking; the copy opens with O_NOFOLLOW). False: `src` is not a regular
    file (it is left out)."""
    try:
        os.link(src, dst, follow_symlinks=False)
        if stat.S_ISREG(os.lstat(dst).st_mode):   # the same inode as src at the time of the link
            return True
        os.unlink(dst)
        return False
    except OSError:
        pass
    try:
        fh = open_regular(src, what="spool segment")       # never a link, never waits on a FIFO
    except FileRefused:
        return False
    with fh:
        with open(dst, "xb") as out:
            while chunk := fh.read(1 << 20):
                out.write(chunk)
    return True


def copy_spooled_records(out_dir: str, new_dir: str) -> int:
    """Put the records held in `out_dir`'s spool, live segments and `--keep-records`' kept/ ones, into a fresh spool
    in `new_dir` (hard links when possible, the originals are never changed); the number of segment files. This is
    the only place here that knows the spool layout (gpu_server/spool/store.py): segments `spool/seg-*.spl` and
    `spool/kept/seg-*.spl`, renumbered into the new spool, which a new server start replays. Only regular files
    named exactly `seg-N.spl` are taken (links are skipped); a record found twice is replayed once (the new spool
    dedupes by run, rank and sequence number)."""
    from gpu_server.spool.segments import KEPT_DIR, is_real_dir, segment_files, segment_path

    src = os.path.join(out_dir, "spool")
    if not is_real_dir(src):
        raise FileNotFoundError(f"{out_dir}: no spool/ folder; is it the --out of a gpu-server?")
    kept = os.path.join(src, KEPT_DIR)
    if os.path.lexists(kept) and not is_real_dir(kept):
        log.warning("recheck: %s is not a folder (a link?); it is left out", kept)
    found = sorted(segment_files(kept) + segment_files(src))     # kept ones are older: first
    _say_left_out([kept, src], {path for _, path in found})
    dst = os.path.join(new_dir, "spool")
    os.makedirs(dst, exist_ok=True)
    n = 0
    for _seg, path in found:
        if _link_or_copy(path, segment_path(dst, n)):
            n += 1
        else:
            log.warning("recheck: %s is not a regular file; it is left out", path)
    return n


def _say_left_out(folders: list[str], taken: set[str]) -> None:
    """One warning line per file named like a segment that is not taken: a link, a FIFO, a device, a folder."""
    from gpu_server.spool.segments import SEGMENT_FILE, is_real_dir

    for folder in folders:
        if not is_real_dir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if SEGMENT_FILE.match(name) and path not in taken:
                log.warning("recheck: %s is not a regular file (a link, a FIFO, ...); it is left out", path)


def recheck(out_dir: str, config: ServerConfig | None = None, device: str | None = None, workers: int | None = None,
            new_dir: str | None = None, extensions: str | None = None) -> tuple[str, list[str], Summary]:
    """Check the records held in `out_dir`'s spool again with this code's standards and thresholds on `device`,
    writing a new set of reports into `new_dir` (default `OUT/recheck_{ts}/`). Returns (new_dir, paths, summary).
    `extensions`: the extension file to recheck with (gpu_server/replay/extensions.py; ExtensionError before anything is
    copied)."""
    if extensions:
        from gpu_server.replay import extensions as ext

        ext.load(extensions)
    new_dir = new_dir or os.path.join(out_dir, "recheck_" + time.strftime("%Y%m%d%H%M%S"))
    if os.path.exists(os.path.join(new_dir, "spool")):
        raise ValueError(f"{new_dir} holds a spool already; give a new folder")
    created = not os.path.exists(new_dir)
    segments = copy_spooled_records(out_dir, new_dir)
    if not segments:
        os.rmdir(os.path.join(new_dir, "spool"))   # made just now, empty
        if created:
            try:
                os.rmdir(new_dir)
            except OSError:
                pass
        raise ValueError(f"{out_dir}/spool holds no records: a server that drained completely deleted them (start "
                         "the server with --keep-records to keep them for a recheck; without it only records not yet "
                         "completely reported, after a crash or a kill, can be checked again)")
    from gpu_server.app import ServerApp  # imports torch: after the cheap checks
    from gpu_server.config import ServerConfig

    app = ServerApp(config or ServerConfig(), new_dir, device=device, workers=workers)
    app.resume()
    for run_id, rank, _seq in {(k[0], k[1], 0) for k in app.spool.seen()}:
        app.pool.end_rank(run_id, rank, "recheck: no more records")
    paths = app.finish()
    damage = app.recovery.damage
    if not app.replayed and not app.quarantined and damage:
        raise ValueError(f"{out_dir}/spool: its {segments} segment files hold no readable record ({len(damage)} "
                         f"damaged regions, {sum(d.skipped for d in damage)} bytes; copies in "
                         f"{os.path.join(new_dir, 'spool', 'damaged')}): nothing was checked again")
    try:
        from gpu_server.reports.html import write_html

        paths.append(write_html(new_dir))
    except Exception as exc:  # noqa: BLE001 - the CSV reports are written; the HTML one is a convenience
        log.warning("recheck: the HTML report could not be written (%s)", exc)
    return new_dir, paths, app.summary


def recheck_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gpu-server recheck", description="Check the records kept in a --out folder's "
                                "spool again (today's thresholds, another bench device), writing new reports beside "
                                "the old ones.")
    p.add_argument("out", help="the server's --out folder")
    p.add_argument("--device", "-d", default=None, help="cpu, cuda or cuda:N (default: every GPU, else CPU)")
    p.add_argument("--workers", type=int, default=None, help="CPU worker threads")
    p.add_argument("--config", default=None, help="server config.json whose white/black/rank lists apply")
    p.add_argument("-o", "--output", default=None, help="folder for the new reports (default OUT/recheck_{ts})")
    p.add_argument("--extensions", default=None, metavar="FILE",
                   help="the extension file to recheck with (docs/extensions.md); wins over run_ut.extensions")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[gpu-server] %(levelname)s %(message)s", stream=sys.stderr)
    config = None
    if ns.config:   # read here as every file of these tools is (gpu_server/safe_open.py), then checked
        from gpu_server.config import ServerConfigError, parse_server_config

        raw = read_json(ns.config, "server config JSON", max_bytes=16 << 20, named=True)
        try:
            config = parse_server_config(raw)
            if config.extensions and not os.path.isabs(config.extensions):   # in the config file's folder
                config = dataclasses.replace(config, extensions=os.path.join(
                    os.path.dirname(os.path.abspath(ns.config)), config.extensions))
        except ServerConfigError as exc:
            raise ValueError(f"--config {ns.config}: {_one_line(str(exc))}") from None
    from gpu_server.replay.extensions import ExtensionError

    try:
        new_dir, paths, summary = recheck(_out_dir(ns.out), config, ns.device, ns.workers, ns.output,
                                          ns.extensions or (config.extensions if config else None) or None)
    except ExtensionError as exc:   # one line per problem, as the server says it at start
        print(f"gpu-server recheck: {exc}", file=sys.stderr)
        return 2
    print(summary.human())
    print(f"reports of the recheck in {new_dir}:")
    for path in paths:
        print(f"  {path}")
    return 0
