"""The HTML report.

Unit level: small `--out` folders built here by hand (the four CSV reports with our Step, Seq, Module and Source
columns, with and without a summary_{ts}.json carrying first_anomaly, nonfinite, modules and api_bias): the page
opens with the first anomaly (module path and source line), then the non-finite verdict, the pooled findings and the
modules; without the JSON it computes the first anomaly and the modules from the CSV rows; hostile module and source
strings are escaped.

End to end (marked slow): the report of a real run with known failures (tests/report_run.py: Functional.gelu.0 and .1
fail forward on rank 0 at steps 0 and 1), rendered by a real browser: Debian's headless Chromium. The DOM after the
page's own script ran must name the failing API with the right counts; the screenshot must not be blank. The
screenshot is kept where REPORT_SCREENSHOT names (docs/report.png is one), else in the test's tmp_path.

The browser tests are skipped, saying so, when `chromium` is not installed (.ci/run installs it with apt-get).
"""
from __future__ import annotations

import csv
import html.parser
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.report_run import FAILING, faulty_out

slow = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y "
                                    "chromium); .ci/run installs it")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
         "--no-first-run", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


@pytest.fixture(scope="module")
def report() -> str:
    from gpu_server.reports.html import write_html

    out = faulty_out()
    return write_html(out, os.path.join(out, "browser-test.html"))


def chromium(*args: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=180)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Cells(html.parser.HTMLParser):
    """Rows of the tables of a DOM dump: {table id: [(row attributes, [cell texts])]}, and element texts by id."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list] = {}
        self.by_id: dict[str, str] = {}
        self._table = None
        self._row = None
        self._cell = None
        self._id_stack: list[tuple[str, str, list]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
            self.tables.setdefault(self._table, [])
        elif tag == "tr" and self._table is not None:
            self._row = (a, [])
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        if tag not in _VOID:    # every open element, so that an element's text ends at its own end tag
            self._id_stack.append((tag, a.get("id"), []))

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row[1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        if any(open_tag == tag for open_tag, _, _ in self._id_stack):
            while self._id_stack:
                open_tag, ident, text = self._id_stack.pop()
                if ident:
                    self.by_id[ident] = "".join(text).strip()
                if open_tag == tag:
                    break

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        for _, ident, text in self._id_stack:
            if ident:
                text.append(data)


@slow
def test_report_is_self_contained(report):
    text = open(report, encoding="utf-8").read()
    assert "<script src" not in text and "<link" not in text and "@import" not in text
    assert not re.search(r"""(src|href)=['"]?(https?:)?//""", text), "the report fetches something from a network"
    assert text.count("<svg") >= 5
    links = {link for link in re.findall(r"href='([^']+)'", text) if not link.startswith("#")}
    evidence = {link for link in links if link.startswith("error_data/")}
    assert len(evidence) == len(FAILING), links               # one error-data folder per failing call
    for link in links - evidence:                             # anything else: a file of the --out folder
        assert os.path.isfile(os.path.join(os.path.dirname(report), link)), link
    # the first anomaly: rank 0's first failing call, its evidence linked
    first = text[text.index("id='first-anomaly'"):text.index("id='failing'")]
    assert "Functional.gelu.0" in first and "error_data/" in first
    for link in evidence:
        folder = os.path.join(os.path.dirname(report), link)
        assert os.path.isfile(os.path.join(folder, "replay.py")) and os.path.isfile(os.path.join(folder, "call.json"))


@slow
@needs_chromium
def test_browser_dom_names_the_failing_api_and_counts(report):
    t0 = time.time()
    proc = chromium("--dump-dom", "file://" + report)
    assert proc.returncode == 0 and "</html>" in proc.stdout, proc.stderr[-2000:]
    dom = _Cells()
    dom.feed(proc.stdout)
    assert dom.by_id["n-error"] == str(len(FAILING))
    assert dom.by_id["shown"] == str(len(FAILING))           # the page's script ran and counted the table
    calls = [(a, cells) for a, cells in dom.tables["calls"] if a.get("data-verdict")]
    assert {(int(c[3]), c[2], int(c[4])) for a, c in calls if a["data-verdict"] == "error"} == FAILING
    assert {a["data-api"] for a, _ in calls} == {"Functional.gelu"}
    apis = {cells[0]: cells for _, cells in dom.tables["api-table"][1:]}
    assert apis["Functional.gelu"][2] == str(len(FAILING))   # the error column
    assert all(cells[2] == "0" for name, cells in apis.items() if name != "Functional.gelu")
    ranks = {cells[0]: cells for _, cells in dom.tables["rank-table"][1:]}
    assert ranks["0"][2] == str(len(FAILING)) and ranks["1"][2] == "0"
    assert "Functional.gelu" in dom.by_id.get("distributions", "") or "Functional.gelu" in proc.stdout
    print(f"\nchromium --dump-dom: {time.time() - t0:.1f} s")
    # the page's filter, driven by the link (#filter=...): only that call's rows stay shown
    proc = chromium("--dump-dom", "file://" + report + "#filter=Functional.gelu.1&status=error")
    dom = _Cells()
    dom.feed(proc.stdout)
    assert dom.by_id["shown"] == "2", dom.by_id["shown"]
    hidden = {cells[2] for a, cells in dom.tables["calls"] if "display: none" in (a.get("style") or "")}
    assert hidden == {"Functional.gelu.0"}


@slow
@needs_chromium
def test_browser_screenshot_is_not_blank(report, tmp_path):
    from PIL import Image

    keep = os.environ.get("REPORT_SCREENSHOT") or str(tmp_path / "report.png")   # REPORT_SCREENSHOT: kept there
    t0 = time.time()
    proc = chromium("--window-size=1400,2000", f"--screenshot={keep}", "file://" + report)
    assert proc.returncode == 0 and os.path.exists(keep), proc.stderr[-2000:]
    image = Image.open(keep).convert("RGB")
    assert image.size == (1400, 2000)
    small = image.resize((350, 500))
    raw = small.tobytes()
    pixels = [tuple(raw[i:i + 3]) for i in range(0, len(raw), 3)]
    background = max(set(pixels), key=pixels.count)
    ink = sum(1 for p in pixels if sum(abs(a - b) for a, b in zip(p, background)) > 60)
    red = sum(1 for r, g, b in pixels if r > 180 and g < 80 and b < 80)     # the failing verdicts and bars
    assert ink > 0.03 * len(pixels), f"the screenshot is nearly blank ({ink} of {len(pixels)} pixels)"
    assert red > 50, "no red (failing) marks on the screenshot"
    print(f"\nchromium --screenshot: {time.time() - t0:.1f} s; kept at {keep}")


def test_runs_that_share_rank_call_and_step_stay_separate_calls():
    """Report rows carry no run id: three training runs sending the same call of the same rank and step to one
    session are three calls, not nine (a merge on the keys alone multiplied them: 1,025 runs gave 1,050,625)."""
    import pandas as pd

    from gpu_server.reports.html import _calls

    def frame(statuses):
        return pd.DataFrame({"rank": [0] * 3, "ts": ["t"] * 3, "call": ["Functional.relu.0"] * 3, "step": [0] * 3,
                             "forward": statuses, "backward": [" "] * 3, "message": [" "] * 3})

    calls = _calls({"precision_result": frame(["pass", "error", "pass"]),
                    "result": frame(["pass", "error", "Warning"])})
    assert len(calls) == 3
    assert list(calls["verdict"]) == ["pass", "error", "Warning"]


# -- unit level: hand-built --out folders ------------------------------------------------------------------------
TS = "20250101120000"
EXTRA = ["Step", "Seq", "Module", "Source"]
HOSTILE_MODULE = "TinyLM.<script>alert(1)</script>.proj"
HOSTILE_SOURCE = "train.py:7 (<img src=x onerror=alert(2)>)"
# (rank, step, seq, call, direction, module, source, verdict); rank 1's first failure is later in raw Seq but
# earlier in its step (position 1 against rank 0's 2): the earliest across ranks
CALLS = [
    (0, 0, 0, "Functional.embedding.0", "forward", "TinyLM.embed", "model.py:20 (forward)", "pass"),
    (0, 0, 1, "Functional.linear.0", "forward", "TinyLM.blocks.0.mlp.fc1", "model.py:31 (forward)", "pass"),
    (0, 0, 2, "Functional.gelu.0", "forward", "TinyLM.blocks.0.mlp.act", "train.py:42 (forward)", "error"),
    (0, 0, 3, "Functional.linear.1", "forward", "TinyLM.blocks.0.mlp.fc2", "model.py:33 (forward)", "Warning"),
    (0, 1, 4, "Functional.embedding.0", "forward", "TinyLM.embed", "model.py:20 (forward)", "pass"),
    (0, 1, 6, "Functional.gelu.0", "forward", "TinyLM.blocks.0.mlp.act", "train.py:42 (forward)", "error"),
    (0, 1, 7, "Tensor.add.0", "forward", "", "train.py:60 (step)", "pass"),
    (1, 0, 10, "Functional.embedding.0", "forward", "TinyLM.embed", "model.py:20 (forward)", "pass"),
    (1, 0, 11, "Functional.linear.0", "forward", HOSTILE_MODULE, HOSTILE_SOURCE, "error"),
    (1, 0, 12, "Functional.gelu.0", "forward", "TinyLM.blocks.0.mlp.act", "train.py:42 (forward)", "pass"),
]


def _write(path: str, header: list[str], rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8-sig", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        for row in rows:
            writer.writerow([row.get(c, " ") for c in header])


def build_out(root: str, summary: dict | None = None, calls=CALLS, extra=EXTRA) -> str:
    """An --out folder of one session: the four CSV reports of each rank (our columns `extra` after msprobe's),
    and `summary` as summary_{TS}.json when given."""
    from gpu_server.columns import DETAILS_HEADER, PRECISION_DETAILS_HEADER, PRECISION_RESULT_HEADER, RESULT_HEADER
    from gpu_server.reports import files as report_files

    out = os.path.join(root, "out")
    os.makedirs(out, exist_ok=True)
    for rank in sorted({c[0] for c in calls}):
        result, details, presult, pdetails = [], [], [], []
        for r, step, seq, call, direction, module, source, verdict in calls:
            if r != rank:
                continue
            ours = {"Step": step, "Seq": seq, "Module": module, "Source": source}
            message = f"{call}: relative error 0.5 over the threshold" if verdict == "error" else ""
            fwd = {"error": "error", "Warning": "Warning"}.get(verdict, "pass")
            row = f"{call}.{direction}.output.0"
            result.append({"API name": call, "Forward Test Success": fwd, "Backward Test Success": " ",
                           "Message": message, **ours})
            presult.append({"API Name": call, "Forward Test Success": fwd, "Backward Test Success": " ",
                            "Message": message, **ours})
            details.append({"API Name": row, "Bench Dtype": "torch.float32", "DEVICE Dtype": "torch.bfloat16",
                            "Shape": "[4, 8]", "余弦相似度": 0.99 if verdict == "error" else 1.0,
                            "最大绝对误差": 0.5 if verdict == "error" else 0.001, "相对误差平均值": 0.02,
                            "Status": fwd, "Message": message, **ours})
            pdetails.append({"API Name": row, "相对误差平均值比值": 3.5 if verdict == "error" else 1.1,
                             "均方根误差比值": 2.5 if verdict == "error" else 1.0, "比对结果": fwd,
                             "比对算法": "标杆比对法", "Message": message, **ours})
        for kind, header, rows in ((report_files.RESULT, RESULT_HEADER, result),
                                   (report_files.DETAILS, DETAILS_HEADER, details),
                                   (report_files.PRECISION_RESULT, PRECISION_RESULT_HEADER, presult),
                                   (report_files.PRECISION_DETAILS, PRECISION_DETAILS_HEADER, pdetails)):
            _write(report_files.path(out, kind, TS, rank), header + extra, rows)
    if summary is not None:
        with open(report_files.summary_path(out, TS), "w", encoding="utf-8") as fh:
            json.dump(summary, fh)
    return out


def _entry(rank, call, step, seq, module, source, **more) -> dict:
    return {"rank": rank, "call": call, "row": f"{call}.forward.output.0", "step": step, "seq": seq,
            "direction": "forward", "module": module, "source": source, "report": "api_precision_compare",
            "status": "error", "message": f"{call}: relative error over the threshold", **more}


SUMMARY = {
    "first_anomaly": {
        "earliest": _entry(1, "Functional.linear.0", 0, 11, HOSTILE_MODULE, HOSTILE_SOURCE),
        "by_rank": {"0": _entry(0, "Functional.gelu.0", 0, 2, "TinyLM.blocks.0.mlp.act", "train.py:42 (forward)"),
                    "1": _entry(1, "Functional.linear.0", 0, 11, HOSTILE_MODULE, HOSTILE_SOURCE)}},
    "nonfinite": {
        "verdict": "the training's own overflow: the bench overflows at the same call",
        "origin": {"rank": 0, "call": "Functional.softmax.3", "step": 1, "seq": 5, "direction": "forward",
                   "module": "TinyLM.blocks.1.attn", "source": "model.py:77 (forward)", "device": True,
                   "bench": True},
        "by_rank": {"0": {"origin": {"rank": 0, "call": "Functional.softmax.3", "step": 1, "seq": 5,
                                     "direction": "forward", "module": "TinyLM.blocks.1.attn",
                                     "source": "model.py:77 (forward)", "device": True, "bench": True},
                          "first_input": {"rank": 0, "call": "Functional.embedding.0", "step": 2, "seq": 9,
                                          "direction": "forward", "module": "TinyLM.embed",
                                          "source": "model.py:20 (forward)", "device": False, "bench": False}},
                    "1": {"origin": None, "first_input": None}}},
    "modules": [{"module": "TinyLM.blocks.0.mlp.act", "calls": 3, "errors": 2, "warnings": 0},
                {"module": HOSTILE_MODULE, "calls": 1, "errors": 1, "warnings": 0},
                {"module": "TinyLM.blocks.0.mlp.fc2", "calls": 1, "errors": 0, "warnings": 1},
                {"module": "TinyLM.embed", "calls": 3, "errors": 0, "warnings": 0}],
    "api_bias": {
        "false_alarm_rate_per_api": 0.001, "fail_above_ulp": 0.5, "tests": 6,
        "apis": [{"api": "Functional.linear", "direction": "forward", "dtype": "bfloat16", "calls": 4,
                  "elements": 128, "bias_ulp": 0.01, "magnitude_bias_ulp": 0.02, "spread_ratio": 1.01,
                  "detectable_ulp": 0.05, "verdict": "pass"},
                 {"api": "Functional.gelu", "direction": "forward", "dtype": "bfloat16", "calls": 3,
                  "elements": 96, "bias_ulp": 0.21, "magnitude_bias_ulp": 0.3, "spread_ratio": 1.4,
                  "detectable_ulp": 0.04, "verdict": "finding"},
                 {"api": "Functional.silu<b>", "direction": "backward", "dtype": "float16", "calls": 2,
                  "elements": 64, "bias_ulp": -0.9, "magnitude_bias_ulp": 0.9, "spread_ratio": 2.0,
                  "detectable_ulp": 0.1, "verdict": "error"}],
        "findings": []},
}
SUMMARY["api_bias"]["findings"] = [a for a in SUMMARY["api_bias"]["apis"] if a["verdict"] != "pass"]


def _tables(text: str) -> _Cells:
    dom = _Cells()
    dom.feed(text)
    return dom


def _no_hostile_markup(text: str) -> None:
    assert "<script>alert(1)" not in text, "a module path was written as markup"
    assert "<img src=x" not in text, "a source line was written as markup"
    assert "TinyLM.&lt;script&gt;alert(1)&lt;/script&gt;.proj" in text
    assert "&lt;img src=x onerror=alert(2)&gt;" in text


def test_first_anomaly_and_modules_from_the_csv_rows_alone(tmp_path):
    """No summary JSON: the first anomaly per rank is its failing row with the smallest Seq; across ranks the
    earliest (step, place in the step): rank 1's Functional.linear.0 (2nd call of its step 0) before rank 0's
    Functional.gelu.0 (3rd call of its step 0), though its Seq is larger. The modules come from the calls."""
    from gpu_server.reports.html import render

    out = build_out(str(tmp_path))
    evidence = os.path.join(out, "error_data", TS, "run-a", "rank1", "Functional.linear.0.step0")
    os.makedirs(evidence)
    text = render(out)
    _no_hostile_markup(text)
    order = [text.index(f"id='{ident}'") for ident in ("first-anomaly", "modules", "failing", "verdicts",
                                                        "distributions", "trends", "ranks")]
    assert order == sorted(order), "the sections are out of their top-down order"
    assert "id='nonfinite'" not in text and "id='api-bias'" not in text   # nothing to say without the JSON
    earliest = text[text.index("id='earliest'"):text.index("id='first-table'")]
    assert "Functional.linear.0" in earliest and "rank 1" in earliest and "step 0" in earliest
    assert "TinyLM.&lt;script&gt;" in earliest and "&lt;img src=x" in earliest
    assert "href='error_data/20250101120000/run-a/rank1/Functional.linear.0.step0/'" in earliest
    dom = _tables(text)
    first = {cells[0]: cells for _, cells in dom.tables["first-table"][1:]}
    assert first["0"][:6] == ["0", "0", "2", "Functional.gelu.0", "Functional.gelu.0.forward.output.0", "forward"]
    assert first["0"][6] == "TinyLM.blocks.0.mlp.act" and first["0"][7] == "train.py:42 (forward)"
    assert first["1"][3] == "Functional.linear.0" and first["1"][6] == HOSTILE_MODULE
    assert [a.get("class") for a, cells in dom.tables["first-table"][1:]] == [None, "earliest"]
    modules = [cells for _, cells in dom.tables["module-table"][1:]]
    assert modules[0] == ["TinyLM.blocks.0.mlp.act", "3", "2", "0"]             # worst first
    assert modules[1] == [HOSTILE_MODULE, "1", "1", "0"]
    assert modules[2] == ["TinyLM.blocks.0.mlp.fc2", "1", "0", "1"]
    assert ["outside modules", "1", "0", "0"] in modules
    # the failing-calls table: each call with its module path and source line
    calls = {(cells[3], cells[2], cells[4]): cells for a, cells in dom.tables["calls"] if a.get("data-verdict")}
    assert calls[("0", "Functional.gelu.0", "1")][5:7] == ["TinyLM.blocks.0.mlp.act", "train.py:42 (forward)"]
    assert calls[("1", "Functional.linear.0", "0")][5:7] == [HOSTILE_MODULE, HOSTILE_SOURCE]
    assert len(calls) == 4


def test_the_summary_json_drives_the_top_of_the_page(tmp_path):
    """With summary_{ts}.json: its first anomaly, the non-finite verdict in plain words, the pooled findings
    (findings highlighted, hostile API names escaped) and its module table, in that order, above the calls."""
    from gpu_server.reports import files as report_files
    from gpu_server.reports.html import render

    out = build_out(str(tmp_path), SUMMARY)
    with open(os.path.join(out, f"api_bias_{TS}.csv"), "w", encoding="utf-8") as fh:
        fh.write("api,direction\n")
    text = render(out)
    _no_hostile_markup(text)
    assert "Functional.silu<b>" not in text and "Functional.silu&lt;b&gt;" in text
    order = [text.index(f"id='{ident}'") for ident in ("first-anomaly", "nonfinite", "api-bias", "modules",
                                                        "failing", "verdicts")]
    assert order == sorted(order), "the sections are out of their top-down order"
    nav = text[text.index("<nav>"):text.index("</nav>")]
    assert "#nonfinite" in nav and "#api-bias" in nav
    assert f"from {os.path.basename(report_files.summary_path(out, TS))}" in text
    dom = _tables(text)
    assert dom.by_id["nonfinite-verdict"] == "the training's own overflow: the bench overflows at the same call"
    origin = dom.by_id["nonfinite-origin"]
    assert "Functional.softmax.3" in origin and "TinyLM.blocks.1.attn" in origin and "model.py:77" in origin
    assert "device output non-finite: yes" in origin and "bench in the device dtype non-finite: yes" in origin
    assert "not a device fault" in origin
    nonfinite = {cells[0]: cells for _, cells in dom.tables["nonfinite-table"][1:]}
    assert nonfinite["0"][5:7] == ["yes", "yes"] and nonfinite["0"][7].startswith("Functional.embedding.0")
    assert nonfinite["1"][1] == "none"
    bias = dom.tables["bias-table"]
    assert bias[0][1] == ["API", "direction", "dtype", "calls", "elements", "bias (ULP)", "magnitude bias (ULP)",
                          "spread ratio", "smallest detectable bias (ULP)", "verdict"]
    rows = [(a, cells) for a, cells in bias[1:]]
    assert [cells[-1] for _, cells in rows] == ["error", "finding", "pass"]      # findings first
    assert rows[1][1][:9] == ["Functional.gelu", "forward", "bfloat16", "3", "96", "0.21", "0.3", "1.4", "0.04"]
    assert [a.get("class") for a, _ in rows] == ["hot", "hot", ""]               # findings highlighted
    assert f"href='api_bias_{TS}.csv'" in text
    modules = [cells for _, cells in dom.tables["module-table"][1:]]
    assert [m[0] for m in modules] == ["TinyLM.blocks.0.mlp.act", HOSTILE_MODULE, "TinyLM.blocks.0.mlp.fc2",
                                       "TinyLM.embed"]
    first = {cells[0]: cells for _, cells in dom.tables["first-table"][1:]}
    assert first["1"][6] == HOSTILE_MODULE and first["1"][7] == HOSTILE_SOURCE


@pytest.mark.parametrize("origin,words", [
    ({"device": True, "bench": False}, "a device fault"),
    ({"device": True, "bench": True}, "not a device fault"),
    ({"device": False, "bench": False}, "neither the device nor the bench overflows"),
])
def test_nonfinite_in_plain_words(origin, words):
    from gpu_server.reports.html import _section_nonfinite

    text = "".join(_section_nonfinite({"verdict": "", "origin": {"rank": 0, "call": "Functional.exp.0", "step": 0,
                                                                 **origin}, "by_rank": {}}))
    assert f"In plain words: {words}" in text
    assert _section_nonfinite({"verdict": "", "origin": None, "by_rank": {"0": {"origin": None,
                                                                                 "first_input": None}}}) == []
    # no origin among the checked calls: the values came in from outside them
    text = "".join(_section_nonfinite({"verdict": "", "origin": None, "first_input": {
        "rank": 1, "call": "Functional.linear.7", "step": 3, "direction": "forward", "module": "M.<i>x</i>",
        "source": "train.py:9 (step)"}, "by_rank": {}}))
    assert "First call with non-finite inputs" in text and "Functional.linear.7" in text
    assert "not a device fault of a checked call" in text and "M.&lt;i&gt;x&lt;/i&gt;" in text


def test_older_folders_and_odd_summaries_still_render(tmp_path):
    """No Seq/Module/Source columns (an older agent or server), and a summary JSON with no first anomaly (its rows
    had no Seq), nulls or wrong types: the page renders, the first anomaly from the step and file order, the module
    table saying it has no paths."""
    from gpu_server.reports.html import render

    out = build_out(str(tmp_path), {"first_anomaly": {"earliest": None, "by_rank": {"0": "junk"}},
                                    "nonfinite": None, "api_bias": {"apis": "junk", "findings": [1, None]},
                                    "modules": "junk"}, extra=["Step"])
    for summary in (True, False):
        if not summary:
            os.remove(os.path.join(out, f"summary_{TS}.json"))
        text = render(out)
        assert "id='bias-table'" not in text and "id='nonfinite-table'" not in text
        assert "No call failed." not in text and "computed from the CSV rows" in text
        assert "no module paths" in text
    dom = _tables(text)
    first = {cells[0]: cells for _, cells in dom.tables["first-table"][1:]}
    assert first["0"][3] == "Functional.gelu.0" and first["0"][1] == "0" and first["0"][2] == ""
    assert first["1"][3] == "Functional.linear.0"
    assert "no module paths" in text
    calls = [cells for a, cells in dom.tables["calls"] if a.get("data-verdict")]
    assert len(calls) == 4 and all(c[5] == "outside modules" and c[6] == "" for c in calls)


def test_no_failure_says_so(tmp_path):
    from gpu_server.reports.html import render

    passing = [c[:7] + ("pass",) for c in CALLS]
    text = render(build_out(str(tmp_path), calls=passing))
    assert "No call failed." in text and "id='first-table'" not in text


@slow
@needs_chromium
def test_browser_renders_the_top_down_view(tmp_path):
    """The hand-built page with a summary in a real browser: the script runs (a module's link filters the calls),
    no hostile string became an element, and the screenshot (kept: REPORT_TOPDOWN_SCREENSHOT) is not blank."""
    from PIL import Image

    from gpu_server.reports.html import write_html

    out = build_out(str(tmp_path), SUMMARY)
    os.makedirs(os.path.join(out, "error_data", TS, "run-a", "rank1", "Functional.linear.0.step0"))
    page = write_html(out)
    proc = chromium("--dump-dom", "file://" + page + "#filter=TinyLM.blocks.0.mlp.act&status=error")
    assert proc.returncode == 0 and "</html>" in proc.stdout, proc.stderr[-2000:]
    dom = _tables(proc.stdout)
    assert dom.by_id["shown"] == "2"
    assert "<script>alert" not in proc.stdout and "<img src=x" not in proc.stdout
    keep = os.environ.get("REPORT_TOPDOWN_SCREENSHOT") or str(tmp_path / "topdown.png")
    proc = chromium("--window-size=1400,1600", f"--screenshot={keep}", "file://" + page)
    assert proc.returncode == 0 and os.path.exists(keep), proc.stderr[-2000:]
    small = Image.open(keep).convert("RGB").resize((350, 400))
    raw = small.tobytes()
    pixels = [tuple(raw[i:i + 3]) for i in range(0, len(raw), 3)]
    top = pixels[: len(pixels) // 4]                 # the first anomaly's red frame is near the top
    assert sum(1 for r, g, b in top if r > 180 and g < 80 and b < 80) > 10, "no red first-anomaly box at the top"
    print(f"\nkept at {keep}")
