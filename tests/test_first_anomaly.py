"""Say where it went wrong (README, "Reading the report"): real trainings on the second, correct device with one
faulty kernel each, one real server, two ranks. The summary JSON, `gpu-server summary` and the HTML report name the
first failing call in execution order, per rank and across ranks, with its module path and source line."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from tests import support
from tests.faulty_kernels import run_trainings
from tests.test_html_report import chromium, needs_chromium

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("first"))
    with support.Server(work, args=("--workers", "1")) as server:
        cfg = support.agent_config(os.path.join(work, "agent.json"), server.port)
        run_trainings(cfg, [["--model", "tinylm", "--dtype", "bfloat16", "--case", "gelu_forward", "--second-device"],
                            ["--model", "tinylm", "--dtype", "float16", "--case", "gelu_backward",
                             "--second-device"]])
        server.stop()
    return server.out


def _summary(out: str) -> dict:
    return json.load(open(glob.glob(os.path.join(out, "summary_*.json"))[0], encoding="utf-8"))


def test_the_summary_names_the_first_failing_call_with_module_and_source(run):
    first = _summary(run)["first_anomaly"]
    rank0, rank1 = first["by_rank"]["0"], first["by_rank"]["1"]
    # rank 0: gelu's forward is wrong; its first call is in the first block's MLP, called from examples/demo.py
    assert rank0["call"] == "Functional.gelu.0" and rank0["direction"] == "forward", rank0
    assert rank0["module"] == "TinyLM.blocks.0", rank0
    assert rank0["source"].startswith(os.path.join("examples", "demo.py") + ":"), rank0
    assert os.path.isfile(os.path.join(rank0["evidence"], "replay.py")), rank0     # its evidence, to replay it
    line = int(rank0["source"].split(":")[1].split()[0])
    assert "F.gelu(" in open(os.path.join(support.ROOT, "examples", "demo.py")).read().splitlines()[line - 1]
    # rank 1: gelu's backward is wrong; backward runs the blocks in reverse, so the last block's gelu comes first
    assert rank1["call"] == "Functional.gelu.1" and rank1["direction"] == "backward", rank1
    assert rank1["module"] == "TinyLM.blocks.1", rank1
    assert rank1["source"] == rank0["source"]                   # a backward row carries its forward call's place
    # across ranks: the forward of step 0 comes before any backward
    assert first["earliest"]["rank"] == 0 and first["earliest"]["call"] == "Functional.gelu.0"
    modules = {m["module"]: m for m in _summary(run)["modules"]}
    assert modules["TinyLM.blocks.0"]["errors"] >= 1 and modules["TinyLM.blocks.1"]["errors"] >= 1
    assert modules.get("TinyLM", {"errors": 0})["errors"] == 0


def test_gpu_server_summary_prints_it_and_fail_on_still_works(run):
    proc = subprocess.run([sys.executable, "-m", "gpu_server.cli", "summary", run, "--fail-on", "error"],
                          capture_output=True, text=True, cwd=support.ROOT, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    first = next(i for i, x in enumerate(lines) if "FIRST FAILING CALL" in x)
    assert first <= 2, proc.stdout                               # it opens the summary
    assert "Functional.gelu.0 forward (rank 0, step 0) in TinyLM.blocks.0 at examples" in lines[first], lines[first]
    assert any("first on rank 1: Functional.gelu.1 backward" in x for x in lines), proc.stdout
    assert "evidence (its tensors and replay.py): " in lines[first + 2], proc.stdout


def test_the_html_report_opens_with_it(run):
    page = open(sorted(glob.glob(os.path.join(run, "report_*.html")))[-1], encoding="utf-8").read()
    section = page.find("<h2 id='first-anomaly'>")
    assert 0 <= section < page.find("<h2 id='failing'>"), "the first anomaly opens the page"
    box = page[section:page.find("<h2", section + 4)]
    assert "Functional.gelu.0" in box and "TinyLM.blocks.0" in box and "examples/demo.py:" in box
    assert "Functional.gelu.1" in box and "backward" in box          # rank 1's first, in the per-rank table


@needs_chromium
def test_the_rendered_page_shows_it_first(run):
    page = sorted(glob.glob(os.path.join(run, "report_*.html")))[-1]
    proc = chromium("--dump-dom", "file://" + page)
    assert proc.returncode == 0 and "</html>" in proc.stdout, proc.stderr[-2000:]
    dom = proc.stdout
    top = dom[dom.index('id="first-anomaly"'):dom.index('id="failing"')]
    assert "Functional.gelu.0" in top and "TinyLM.blocks.0" in top and "examples/demo.py:" in top, top[:3000]
    assert dom.index('id="first-anomaly"') < dom.index('id="modules"') < dom.index('id="failing"')
