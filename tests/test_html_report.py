"""The HTML report of a real run with known failures (tests/report_run.py: Functional.gelu.0 and .1 fail forward on
rank 0 at steps 0 and 1), rendered by a real browser: Debian's headless Chromium. The DOM after the page's own
script ran must name the failing API with the right counts; the screenshot must not be blank. The screenshot is kept
(REPORT_SCREENSHOT, default a temporary folder; docs/report.png is one).

Skipped, saying so, when `chromium` is not installed (.ci/run installs it with apt-get).
"""
from __future__ import annotations

import html.parser
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.report_run import FAILING, faulty_out

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y "
                                    "chromium); .ci/run installs it")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
         "--no-first-run", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


@pytest.fixture(scope="module")
def report() -> str:
    from gpu_server.html_report import write_html

    out = faulty_out()
    return write_html(out, os.path.join(out, "browser-test.html"))


def chromium(*args: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=180)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


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
        if a.get("id"):
            self._id_stack.append((tag, a["id"], []))

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row[1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        if self._id_stack and self._id_stack[-1][0] == tag:
            _, ident, text = self._id_stack.pop()
            self.by_id[ident] = "".join(text).strip()

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        for _, _, text in self._id_stack:
            text.append(data)


def test_report_is_self_contained(report):
    text = open(report, encoding="utf-8").read()
    assert "<script src" not in text and "<link" not in text and "@import" not in text
    assert not re.search(r"""(src|href)=['"]?(https?:)?//""", text), "the report fetches something from a network"
    assert text.count("<svg") >= 5
    links = re.findall(r"href='([^']+)'", text)
    assert len(links) == len(FAILING), links                 # one error-data folder per failing call
    for link in links:
        folder = os.path.join(os.path.dirname(report), link)
        assert os.path.isfile(os.path.join(folder, "replay.py")) and os.path.isfile(os.path.join(folder, "call.json"))


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


@needs_chromium
def test_browser_screenshot_is_not_blank(report):
    from PIL import Image

    keep = os.environ.get("REPORT_SCREENSHOT") or os.path.join(tempfile.mkdtemp(prefix="report-shot-"), "report.png")
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

    from gpu_server.html_report import _calls

    def frame(statuses):
        return pd.DataFrame({"rank": [0] * 3, "ts": ["t"] * 3, "call": ["Functional.relu.0"] * 3, "step": [0] * 3,
                             "forward": statuses, "backward": [" "] * 3, "message": [" "] * 3})

    calls = _calls({"precision_result": frame(["pass", "error", "pass"]),
                    "result": frame(["pass", "error", "Warning"])})
    assert len(calls) == 3
    assert list(calls["verdict"]) == ["pass", "error", "Warning"]
