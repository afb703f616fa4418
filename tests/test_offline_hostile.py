"""The offline tools (`gpu-server report | summary | compare | recheck`) on hostile and malformed inputs: a FIFO or a
symbolic link named like a report, a summary JSON, a config or a spool segment; truncated and garbage CSV reports,
bad JSON, wrong types, non-UTF-8 bytes, a huge field. Each must return at once with exit status 2 and exactly one
line on stderr naming the file, never a traceback, never wait on a pipe and never read through a link found in a
folder (gpu_server/safe_open.py).

The --out folder is written by the server's own writers (gpu_server/reports/rank_reports.py RankReports,
Summary.write_json): two
calls on one rank, one failing. Each case damages one file of its own copy. The main cases run the real CLI, each in
its own subprocess, all at once; the whole matrix of malformed contents runs through the CLI's entry point
(`gpu_server.cli.main`) in one more subprocess (torch is imported once, not once per case), which records anything
that escapes it (what would be a traceback)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from tests import support

TS = "20260101000000"
TIMEOUT_S = 120     # a command waiting on a FIFO would hang: it is killed and the test fails
ENV = dict(os.environ, PYTHONPATH=support.ROOT)
ENV.pop("GPU_SERVER_TRACEBACK", None)

# One process, every case through gpu_server.cli.main: exit status, stdout, stderr, and whatever escaped main().
DRIVER = r'''
import contextlib, io, json, logging, sys, time, traceback
from gpu_server.cli import main

results = []
for argv in json.load(open(sys.argv[1])):
    root = logging.getLogger()
    for handler in list(root.handlers):      # recheck configures logging to the stderr of its own case
        root.removeHandler(handler)
    out, err, escaped, rc = io.StringIO(), io.StringIO(), None, None
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        except BaseException:
            escaped = traceback.format_exc()
    results.append({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "escaped": escaped,
                    "took": time.monotonic() - start})
json.dump(results, open(sys.argv[2], "w"))
'''


def refused(case: str, res: dict, *words: str) -> None:
    """Exit status 2, exactly one line on stderr containing `words`, no traceback, no last-resort message."""
    lines = res["stderr"].splitlines()
    assert res.get("escaped") is None, (case, res["escaped"])
    assert res["rc"] == 2, (case, res["rc"], res["stdout"][-300:], res["stderr"][-1500:])
    assert "Traceback" not in res["stderr"], (case, res["stderr"])
    assert len(lines) == 1, (case, res["stderr"])
    assert "cannot finish" not in lines[0], (case, lines[0])     # a foreseen case has its own message
    for w in words:
        assert w in lines[0], (case, w, lines[0])


def run_parallel(commands: dict[str, list[str]], at_once: int = 4) -> dict[str, dict]:
    """The real CLI (`python -m gpu_server.cli ...`), one subprocess per case, `at_once` at a time."""
    results: dict[str, dict] = {}
    todo = list(commands.items())
    while todo:
        batch, todo = todo[:at_once], todo[at_once:]
        procs = {case: (subprocess.Popen([support.PY, "-m", "gpu_server.cli", *argv], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=ENV),
                        time.monotonic()) for case, argv in batch}
        for case, (proc, start) in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for p, _ in procs.values():
                    p.kill()
                pytest.fail(f"{case}: gpu-server {commands[case][0]} did not return (waiting on a FIFO?)")
            results[case] = {"rc": proc.returncode, "stdout": stdout, "stderr": stderr,
                             "took": time.monotonic() - start}
    return results


def run_in_one_process(commands: dict[str, list[str]], tmp) -> dict[str, dict]:
    cases, argvs = list(commands), list(commands.values())
    args_path, out_path = str(tmp / "argv.json"), str(tmp / "results.json")
    with open(args_path, "w") as fh:
        json.dump(argvs, fh)
    proc = subprocess.run([support.PY, "-c", DRIVER, args_path, out_path], capture_output=True, text=True,
                          timeout=TIMEOUT_S * 2, env=ENV, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out_path) as fh:
        return dict(zip(cases, json.load(fh)))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    """A --out folder as a server writes it: rank 0, two calls (Functional.gelu.0 fails), the summary JSON."""
    from gpu_server.reports.rank_reports import (
        RankReports,
        Where,
        detail_row,
        precision_detail_row,
        precision_result_row,
        result_row,
    )
    from gpu_server.reports.summary import Summary

    out = str(tmp_path_factory.mktemp("good"))
    rep = RankReports(out, TS, 0)
    for seq, (call, status) in enumerate((("Functional.linear.0", "pass"), ("Functional.gelu.0", "error"))):
        where = Where(seq=seq, module="model.layer", source="train.py:10")
        rep.write([result_row(call, status, " ", "", 0, where)])
        rep.write([precision_result_row(call, status, " ", "", 0, where)])
        rep.write([detail_row(f"{call}.forward.output.0", "torch.float32", "torch.bfloat16", "(4, 8)", None, status,
                              "", 0, where)])
        ratio = 1.0 if status == "pass" else 9.0
        rep.write([precision_detail_row(f"{call}.forward.output.0", {"均方根误差比值": ratio}, status, "标杆比对法", "",
                                        0, where)])
    rep.close()
    summary = Summary()
    summary.seed_from_reports(out, TS, strict=True)
    summary.record_received(0)
    summary.write_json(out, TS)
    return out


class Cases:
    """Damaged copies of the good folder, one per case: name -> (argv, words its one stderr line must contain)."""

    def __init__(self, good: str, tmp) -> None:
        self.good, self.tmp = good, tmp
        self.argv: dict[str, list[str]] = {}
        self.words: dict[str, tuple[str, ...]] = {}

    def copy(self, case: str) -> str:
        out = str(self.tmp / case)
        shutil.copytree(self.good, out)
        return out

    def add(self, case: str, argv: list[str], *words: str) -> None:
        self.argv[case], self.words[case] = argv, words


def report_path(out: str, kind: str) -> str:
    return os.path.join(out, f"{kind}_{TS}_rank0.csv")


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def _csv_damage(data: bytes) -> dict[str, bytes]:
    header, first = data.split(b"\r\n")[:2]
    return {
        "truncated_row": data[:-7],                                    # cut in the middle of the last row
        "truncated_header": data[:len(header) // 2],
        "empty": b"",
        "garbage": bytes(range(256)) * 12 + b"\n",
        "non_utf8": data.replace(b"Functional.gelu.0", b"Functional.\xff\xfe.0"),
        "short_row": header + b"\r\n" + first.rsplit(b",", 2)[0] + b"\r\n",
        "long_row": header + b"\r\n" + first + b",extra,cells\r\n",
        "open_quote": data + b'"Functional.x.0,pass\r\n',
        "huge_field": header + b"\r\n" + b"A" * 200_000 + first[first.index(b","):] + b"\r\n",
        "wrong_header": b"name,value\r\nx,1\r\n",
        "nul_bytes": header + b"\r\n" + b"\x00" * 64 + b"\r\n",
    }


BAD_SUMMARIES = {     # summary_{ts}.json contents `gpu-server summary` refuses
    "not_json": b"{not json",
    "truncated": b'{"records_received": {"0": 1}, "calls',
    "a_list": b"[1, 2]",
    "non_utf8": b'{"x": "\xff\xfe"}',
    "count_not_a_number": b'{"records_received": {"0": "many"}}',
    "rank_not_a_number": b'{"ranks_ended": [{"rank": "x"}]}',
    "infinite_count": b'{"transport": {"a": Infinity}}',
    "finding_of_wrong_type": b'{"api_bias": {"findings": [{"verdict": 3}]}}',
    "nested_too_deep": b"[" * 100_000,
    "ranks_ended_not_a_list": b'{"ranks_ended": {"rank": 0}}',
}
BAD_PAGE_SUMMARIES = {     # ... and `gpu-server report` (keys of other types are left out there, by design: the page
    #                         falls back to the CSVs for them, tests/test_html_report.py)
    "not_json": b"{not json",
    "a_list": b"[1, 2]",
    "non_utf8": b"\xff{}",
    "nested_too_deep": b'{"a": ' + b"[" * 100_000,
}


def test_the_main_cases_through_the_real_cli_at_once(good, tmp_path):
    """A FIFO named like a report, a symlinked report, a truncated CSV, a bad summary JSON, non-UTF-8 bytes, a FIFO
    as recheck's config: one subprocess each, each returning at once with one line."""
    from gpu_server.spool.segments import segment_path

    c = Cases(good, tmp_path)
    out = c.copy("fifo_report")
    fifo = report_path(out, "accuracy_checking_details")
    os.unlink(fifo)
    os.mkfifo(fifo)
    c.add("fifo_report", ["report", out], fifo, "FIFO", "not a regular file")
    out = c.copy("symlink_report")
    link = report_path(out, "api_precision_compare_result")
    shutil.move(link, str(tmp_path / "elsewhere.csv"))
    os.symlink(str(tmp_path / "elsewhere.csv"), link)
    c.add("symlink_report", ["report", out], link, "symbolic link")
    out = c.copy("truncated")
    path = report_path(out, "accuracy_checking_result")
    write(path, open(path, "rb").read()[:-9])
    c.add("truncated", ["summary", out], path, "truncated")
    out = c.copy("non_utf8")
    path = report_path(out, "api_precision_compare_details")
    write(path, open(path, "rb").read().replace(b"Functional.gelu.0", b"\xc3\x28gelu"))
    c.add("non_utf8", ["summary", out], path, "not UTF-8")
    out = c.copy("bad_summary_json")
    write(os.path.join(out, f"summary_{TS}.json"), b'{"records_received": {"0": 1}, "ranks_')
    c.add("bad_summary_json", ["summary", out], f"summary_{TS}.json", "not valid JSON")
    out = c.copy("recheck_fifo_config")
    os.makedirs(os.path.join(out, "spool"))
    os.mkfifo(segment_path(os.path.join(out, "spool"), 1))
    config = str(tmp_path / "server.json")
    os.mkfifo(config)
    c.add("recheck_fifo_config", ["recheck", out, "--config", config], config, "FIFO")
    results = run_parallel(c.argv)
    for case, res in results.items():
        refused(case, res, *c.words[case])
        assert res["took"] < TIMEOUT_S / 2, (case, res["took"])     # a FIFO waited on would hang


def test_every_malformed_input_is_one_line_and_exit_2(good, tmp_path):
    """The matrix: every damaged CSV report for `report` and `summary`, every bad summary JSON, a FIFO, a link or a
    folder as the summary JSON, malformed compare inputs, recheck's config and spool (FIFO, link and garbage
    segments), report's output beside a FIFO. The untouched folder passes first (the baseline the damaged copies
    are measured against)."""
    from gpu_server.spool.segments import segment_path

    c = Cases(good, tmp_path)
    ok: dict[str, list[str]] = {"ok_summary": ["summary", c.copy("ok_summary"), "--json"],
                                "ok_report": ["report", c.copy("ok_report")]}
    for tool in ("report", "summary"):
        for kind in ("accuracy_checking_result", "api_precision_compare_details"):
            for damage, data in _csv_damage(open(report_path(good, kind), "rb").read()).items():
                case = f"{tool}-{kind}-{damage}"
                out = c.copy(case)
                write(report_path(out, kind), data)
                c.add(case, [tool, out], report_path(out, kind))
        out = c.copy(f"{tool}-csv-fifo")
        fifo = report_path(out, "accuracy_checking_result")
        os.unlink(fifo)
        os.mkfifo(fifo)
        c.add(f"{tool}-csv-fifo", [tool, out], fifo, "FIFO")
        for what in ("fifo", "link", "folder"):
            case = f"{tool}-summary-json-{what}"
            out = c.copy(case)
            path = os.path.join(out, f"summary_{TS}.json")
            os.unlink(path)
            if what == "fifo":
                os.mkfifo(path)
            elif what == "link":
                os.symlink("/etc/passwd", path)
            else:
                os.mkdir(path)
            c.add(case, [tool, out], path, {"fifo": "FIFO", "link": "symbolic link", "folder": "a folder"}[what])
    for name, data in BAD_SUMMARIES.items():
        out = c.copy(f"summary-json-{name}")
        write(os.path.join(out, f"summary_{TS}.json"), data)
        c.add(f"summary-json-{name}", ["summary", out], f"summary_{TS}.json", "move it out of the folder")
    for name, data in BAD_PAGE_SUMMARIES.items():
        out = c.copy(f"report-json-{name}")
        write(os.path.join(out, f"summary_{TS}.json"), data)
        c.add(f"report-json-{name}", ["report", out], f"summary_{TS}.json", "move it out of the folder")
    # compare: inputs named on the command line (a link there is followed once: the user named it)
    details = report_path(good, "accuracy_checking_details")
    damaged = _csv_damage(open(details, "rb").read())
    for damage in ("truncated_row", "non_utf8", "short_row", "huge_field", "wrong_header", "empty"):
        path = str(tmp_path / f"compare-{damage}.csv")
        write(path, damaged[damage])
        c.add(f"compare-{damage}", ["compare", "-npu", details, "-gpu", path, "-o", str(tmp_path / "cmp")], path)
    fifo = str(tmp_path / "npu.fifo")
    os.mkfifo(fifo)
    c.add("compare-fifo", ["compare", "-npu", fifo, "-gpu", details, "-o", str(tmp_path / "cmp")], fifo, "FIFO")
    c.add("compare-folder", ["compare", "-npu", str(tmp_path), "-gpu", details, "-o", str(tmp_path / "cmp")],
          str(tmp_path), "a folder")
    os.symlink(details, str(tmp_path / "named-link.csv"))
    ok["compare-named-link"] = ["compare", "-npu", str(tmp_path / "named-link.csv"), "-gpu", details, "-o",
                                str(tmp_path / "cmp-ok")]
    # recheck: the config and the spool
    out = c.copy("recheck")
    spool = os.path.join(out, "spool")
    os.makedirs(spool)
    os.mkfifo(segment_path(spool, 1))
    os.symlink("/etc/passwd", segment_path(spool, 2))
    for name, data, words in (("bad-values", b'{"task": "run_ut", "run_ut": {"white_list": 3, "port": "x"}}',
                               ("white_list", "port")),
                              ("not-json", b"{oops", ("not valid JSON",)),
                              ("non-utf8", b'{"run_ut": "\xff"}', ("not UTF-8",))):
        config = str(tmp_path / f"config-{name}.json")
        write(config, data)
        c.add(f"recheck-config-{name}", ["recheck", out, "--config", config], config, *words)
    target = str(tmp_path / "page.html")
    os.mkfifo(target + ".tmp")
    c.add("report-output-beside-a-fifo", ["report", c.copy("report-output"), "-o", target], target + ".tmp",
          "not a regular file")

    # random bytes named like a spool segment: the recheck's new server finds no readable record in it (the
    # damage is logged and kept aside); last, as it starts a server in the driver's process
    garbage = c.copy("recheck-garbage")
    os.makedirs(os.path.join(garbage, "spool"))
    write(segment_path(os.path.join(garbage, "spool"), 1), bytes(range(256)) * 20)
    results = run_in_one_process({**ok, **c.argv,
                                  "recheck-fifo-and-link-segments": ["recheck", out, "-o", str(tmp_path / "new")],
                                  "recheck-garbage": ["recheck", garbage, "-o", str(tmp_path / "new-garbage"),
                                                      "--device", "cpu", "--workers", "1"]}, tmp_path)
    for case in ok:
        res = results.pop(case)
        assert res["rc"] == 0 and res["escaped"] is None, (case, res)
        if case == "ok_summary":
            assert json.loads(res["stdout"])["calls_failed"] == {"0": 1}, res
        if case == "ok_report":
            assert "Functional.gelu" in open(res["stdout"].strip(), encoding="utf-8").read(), res
    left_out = results.pop("recheck-fifo-and-link-segments")
    assert left_out["escaped"] is None and left_out["rc"] == 2, left_out
    assert "holds no records" in left_out["stderr"].splitlines()[-1], left_out["stderr"]
    for n in (1, 2):
        assert f"{os.path.basename(segment_path(spool, n))} is not a regular file" in left_out["stderr"], left_out
    damaged = results.pop("recheck-garbage")
    assert damaged["escaped"] is None and "Traceback" not in damaged["stderr"], damaged
    assert damaged["rc"] == 2 and "hold no readable record" in damaged["stderr"].splitlines()[-1], damaged
    for case, res in results.items():
        refused(case, res, *c.words[case])
        assert res["took"] < TIMEOUT_S / 4, (case, res["took"])


def test_the_safe_open_helper_on_every_kind_of_file(tmp_path):
    """gpu_server/safe_open.py itself: a FIFO (no writer: it would block), a socket, a device, a folder and a link
    are each refused at once with what they are; a link named on the command line is followed once; an output is
    never written through a link nor into a FIFO."""
    import socket

    from gpu_server.safe_open import FileRefused, create_regular, open_regular, read_json

    regular = tmp_path / "a.json"
    regular.write_text('{"a": 1}')
    fifo, sock, link = str(tmp_path / "fifo"), str(tmp_path / "sock"), str(tmp_path / "link")
    os.mkfifo(fifo)
    server = socket.socket(socket.AF_UNIX)
    server.bind(sock)
    os.symlink(str(regular), link)
    for path, what in ((fifo, "FIFO"), (sock, "socket"), ("/dev/null", "character device"),
                       (str(tmp_path), "folder"), (link, "symbolic link"), (str(tmp_path / "none"), "no such file")):
        start = time.monotonic()
        with pytest.raises(FileRefused, match=what) as info:
            open_regular(path)
        assert time.monotonic() - start < 5 and info.value.path == path and "\n" not in str(info.value)
    server.close()
    assert read_json(link, named=True) == {"a": 1} and read_json(str(regular)) == {"a": 1}
    with pytest.raises(FileRefused, match="FIFO"):
        create_regular(fifo)                 # no reader: refused at once, never waits for one
    with pytest.raises(FileRefused, match="symbolic link"):
        create_regular(link)
    assert regular.read_text() == '{"a": 1}'   # not written through the link
    with pytest.raises(FileRefused, match="more than"):
        read_json(str(regular), max_bytes=4)
