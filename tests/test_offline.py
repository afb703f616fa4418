"""The offline tools on reports from a real run with known failures (tests/report_run.py): the reports as a pandas
DataFrame, `gpu-server summary`, `gpu-server compare` (msprobe's api_precision_compare on two machines' details
files), `gpu-server recheck` (a spool written by the real spool code from really captured calls), `gpu-server
report` and the health probe against a real server. Every command runs as the console script, in a subprocess."""
from __future__ import annotations

import csv
import glob
import json
import os
import subprocess

import pytest

from tests import support
from tests.report_run import FAILING, STEPS, faulty_out

pytestmark = pytest.mark.slow
GPU_SERVER = os.path.join(os.path.dirname(support.PY), "gpu-server")


def cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=support.ROOT)
    return subprocess.run([GPU_SERVER, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def out() -> str:
    return faulty_out()


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8-sig", newline="") as fh:
        return list(csv.DictReader(fh))


def test_load_is_one_typed_frame_over_ranks_and_steps(out):
    import pandas as pd

    from gpu_server.columns import PRECISION_DETAILS_HEADER
    from gpu_server.reports import load

    frame = load(out, "precision_details")
    assert list(frame.columns[2:2 + len(PRECISION_DETAILS_HEADER)]) == PRECISION_DETAILS_HEADER
    assert set(frame["rank"]) == {0, 1} and set(frame["step"]) == set(range(STEPS))
    assert frame["均方根误差比值"].dtype == float and pd.api.types.is_integer_dtype(frame["Step"])
    assert frame["rmse_ratio"].equals(frame["均方根误差比值"]) and frame["result"].equals(frame["比对结果"])
    errors = frame[frame["result"] == "error"]
    assert {(r, c, s) for r, c, s in zip(errors["rank"], errors["call"], errors["step"])} == FAILING
    assert set(errors["direction"]) == {"forward"} and set(errors["algorithm"]) == {"标杆比对法"}
    details = load(out)                      # accuracy_checking_details by default
    assert details["cosine"].equals(details["余弦相似度"]) and details["max_abs_err"].dtype == float
    assert len(details) == len(frame)        # one row per output in both files
    results = load(out, "accuracy_checking_result")
    per_rank = results.groupby("rank").size().to_dict()
    saved = json.load(open(glob.glob(os.path.join(out, "summary_*.json"))[0], encoding="utf-8"))
    assert {str(k): v for k, v in per_rank.items()} == saved["calls_checked"]
    with pytest.raises(ValueError, match="unknown report kind"):
        load(out, "nonsense")


def test_load_keeps_columns_it_does_not_know_as_text(out, tmp_path):
    from gpu_server.reports import load

    src = glob.glob(os.path.join(out, "accuracy_checking_details_*_rank0.csv"))[0]
    with open(src, encoding="utf-8-sig", newline="") as fh:
        rows = list(csv.reader(fh))
    with open(tmp_path / os.path.basename(src), "w", encoding="utf-8-sig", newline="") as fh:
        csv.writer(fh).writerows([rows[0] + ["Host"]] + [r + [f"node-{i}"] for i, r in enumerate(rows[1:])])
    frame = load(str(tmp_path))
    assert list(frame["Host"][:2]) == ["node-0", "node-1"] and frame["余弦相似度"].dtype == float


def test_summary_again_matches_the_server_and_fails_ci(out):
    saved = json.load(open(glob.glob(os.path.join(out, "summary_*.json"))[0], encoding="utf-8"))
    proc = cli("summary", out, "--json", "--fail-on", "error")
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    for key in ("calls_checked", "calls_failed", "accuracy_checking_status", "api_precision_compare_status",
                "api_precision_compare_rows_by_standard", "records_received"):
        assert data[key] == saved[key], key
    assert set(data["failing_apis"]) == {"Functional.gelu"} and data["failing_apis"]["Functional.gelu"]["calls"] == 4
    text = cli("summary", out)
    assert text.returncode == 0 and "Functional.gelu: 4 calls" in text.stdout, text.stdout
    missing = cli("summary", os.path.join(out, "no-such-folder"))
    assert missing.returncode == 2 and "no such folder" in missing.stderr


def test_compare_two_machines_details_like_msprobe(out, tmp_path):
    from gpu_server.columns import PRECISION_DETAILS_HEADER, PRECISION_RESULT_HEADER

    npu = glob.glob(os.path.join(out, "accuracy_checking_details_*_rank0.csv"))[0]   # the faulty device
    gpu = glob.glob(os.path.join(out, "accuracy_checking_details_*_rank1.csv"))[0]   # a correct machine
    proc = cli("compare", "-npu", npu, "-gpu", gpu, "-o", str(tmp_path / "faulty"))
    assert proc.returncode == 0, proc.stderr
    result = glob.glob(str(tmp_path / "faulty" / "api_precision_compare_result_*.csv"))
    details = glob.glob(str(tmp_path / "faulty" / "api_precision_compare_details_*.csv"))
    assert len(result) == len(details) == 1
    with open(details[0], encoding="utf-8-sig") as fh:
        assert next(csv.reader(fh)) == PRECISION_DETAILS_HEADER + ["Step"]
    rows = _rows(result[0])
    assert list(rows[0]) == PRECISION_RESULT_HEADER + ["Step"]
    flagged = {(r["API Name"], int(r["Step"])) for r in rows if r["Forward Test Success"] == "error"}
    assert {(c, s) for _, c, s in FAILING} <= flagged, flagged
    assert {name.rsplit(".", 1)[0] for name, _ in flagged} == {"Functional.gelu"}, flagged
    assert len(rows) == len({(r["API Name"], r["Step"]) for r in rows}) > 50
    # the same machine against itself: every ratio is 1, nothing fails
    same = cli("compare", "-npu", gpu, "-gpu", gpu, "-o", str(tmp_path / "same"))
    assert same.returncode == 0, same.stderr
    rows = _rows(glob.glob(str(tmp_path / "same" / "api_precision_compare_result_*.csv"))[0])
    assert {r["Forward Test Success"] for r in rows} == {"pass"}
    bad = cli("compare", "-npu", glob.glob(os.path.join(out, "accuracy_checking_result_*_rank0.csv"))[0],
              "-gpu", gpu, "-o", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "not an accuracy_checking_details file" in bad.stderr


SPOOL_SCRIPT = r'''
import sys
import torch
import torch.nn.functional as F
from gpu_server.intake.assembler import FrameAssembler
from gpu_server.spool.store import Spool
from npu_agent.records import encode_record
from protos import online_check_pb2 as pb
from tests import support
from tests.faulty_kernels import install

torch.manual_seed(0)
torch.set_num_threads(1)
install("gelu_forward")
x = torch.randn(16, 64, dtype=torch.bfloat16)
w = torch.randn(32, 64, dtype=torch.bfloat16)
with support.capture(backward=False) as (mode, sink):
    with mode:
        y = F.linear(F.gelu(x), w)
        z = y * 0.5
spool = Spool(sys.argv[1])
spool.open("20260101000000")
tickets = []
for seq, rec in enumerate(sink):
    rec.seq = seq
    enc = encode_record(rec, "run1", 0)
    record = enc.record
    asm, done = FrameAssembler(), None
    for frame in enc.wire_frames(1 << 20):
        done = asm.feed(pb.Frame.FromString(frame))
    tickets.append(spool.append(*done))
assert all(t.wait(30)[0] == pb.Ack.ACCEPTED for t in tickets)
spool.close()            # like a server killed before it reported: every record stays in the spool
print(" ".join(r.name for r in sink))
'''


def test_recheck_checks_the_spooled_records_again_beside_the_old_reports(tmp_path):
    old = tmp_path / "out"
    old.mkdir()
    made = support.run_training(SPOOL_SCRIPT, str(old), env={"OMP_NUM_THREADS": "1"})
    names = made.stdout.split()
    assert {"Functional.gelu.0", "Functional.linear.0"} <= set(names) and len(names) == 3, names
    segments = sorted(glob.glob(str(old / "spool" / "seg-*.spl")))
    before = {p: os.path.getsize(p) for p in segments}
    assert segments
    proc = cli("recheck", str(old), "--device", "cpu", "-o", str(old / "recheck"))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    new = str(old / "recheck")
    rows = support.by_name(support.read_csv(new, "api_precision_compare_result"), "API Name")
    assert set(rows) == set(names), rows
    assert rows["Functional.gelu.0"]["Forward Test Success"] == "error"
    assert all(r["Forward Test Success"] == "pass" for n, r in rows.items() if n != "Functional.gelu.0")
    assert glob.glob(os.path.join(new, "summary_*.json")) and glob.glob(os.path.join(new, "report_*.html"))
    assert {p: os.path.getsize(p) for p in segments} == before          # the old spool is untouched
    again = cli("recheck", str(old), "-o", new)
    assert again.returncode == 2 and "holds a spool already" in again.stderr
    empty = tmp_path / "empty"
    (empty / "spool").mkdir(parents=True)
    proc = cli("recheck", str(empty))
    assert proc.returncode == 2 and "holds no records" in proc.stderr


def test_report_command_and_the_report_written_at_drain(out, tmp_path):
    assert glob.glob(os.path.join(out, "report_" + "[0-9]" * 14 + ".html")), "no HTML report written at the drain"
    target = str(tmp_path / "r.html")
    proc = cli("report", out, "-o", target)
    assert proc.returncode == 0 and proc.stdout.strip() == target, proc.stderr
    text = open(target, encoding="utf-8").read()
    assert "Functional.gelu" in text and "<svg" in text
    proc = cli("report", str(tmp_path))
    assert proc.returncode == 2 and "no api_precision_compare_result" in proc.stderr


def test_health_probe_against_a_real_server(tmp_path):
    with support.Server(str(tmp_path)) as server:
        up = cli("health", "--host", "127.0.0.1", "--port", str(server.port))
        assert up.returncode == 0 and "SERVING" in up.stdout, up.stderr
    down = cli("health", "--host", "127.0.0.1", "--port", str(server.port), "--timeout", "2")
    assert down.returncode == 1 and "not reachable" in down.stderr


def test_progress_rates_backlog_and_time_to_drain():
    from gpu_server.reports.drain_rate import DrainRate
    from gpu_server.reports.summary import Summary

    now = [100.0]
    rate = DrainRate(window_s=10.0, clock=lambda: now[0])
    assert rate.rates(0, 0) == (0.0, 0.0, 0.0)
    now[0] = 102.0
    assert rate.rates(200, 100) == (100.0, 50.0, 2.0)          # 100 records/s in, 50/s done, 100 left: 2 s
    now[0] = 104.0
    assert rate.rates(200, 100)[2] == 4.0                        # 100 done in 4 s: 25/s
    now[0] = 120.0
    rate.rates(200, 100)
    now[0] = 121.0
    assert rate.rates(200, 100) == (0.0, 0.0, None)              # nothing drains within the window: unknown
    assert rate.line(200, 100).endswith("backlog 100, drain in -")
    summary = Summary()
    summary.backlog = lambda: 7
    summary.record_received(0)
    assert "backlog 7" in summary.progress_line() and "rec/s in" in summary.progress_line()


def test_compare_skips_and_drops_like_msprobe(out, tmp_path):
    """Rows msprobe cannot judge: an invalid name (a SKIP row and result), a float64 output (SKIP), a row the
    reference machine lacks (left out, counted on stderr), a blank metric (SKIP with the reason)."""
    src = glob.glob(os.path.join(out, "accuracy_checking_details_*_rank1.csv"))[0]
    with open(src, encoding="utf-8-sig", newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = reader.fieldnames, [r for r in reader if r["Step"] == "0"]
    linear = next(r for r in rows if r["API Name"] == "Functional.linear.0.forward.output.0")
    gelu = next(r for r in rows if r["API Name"] == "Functional.gelu.0.forward.output.0")
    npu_rows = [dict(linear, **{"API Name": "broken"}), dict(linear, **{"DEVICE Dtype": "torch.float64"}),
                dict(gelu, **{"均方根误差": " "}), dict(gelu, **{"API Name": "Functional.gelu.9.forward.output.0"})]
    gpu_rows = [linear, gelu]
    for name, data in (("npu.csv", npu_rows), ("gpu.csv", gpu_rows)):
        with open(tmp_path / name, "w", encoding="utf-8-sig", newline="") as fh:
            writer = csv.DictWriter(fh, header)
            writer.writeheader()
            writer.writerows(data)
    proc = cli("compare", "-npu", str(tmp_path / "npu.csv"), "-gpu", str(tmp_path / "gpu.csv"), "-o", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "1 rows of" in proc.stderr and "left out" in proc.stderr
    details = _rows(glob.glob(str(tmp_path / "api_precision_compare_details_*.csv"))[0])
    assert [d["API Name"] for d in details] == ["broken", "Functional.linear.0.forward.output.0",
                                                 "Functional.gelu.0.forward.output.0"]
    assert [d["比对结果"] for d in details] == ["SKIP", "SKIP", "SKIP"]
    assert details[0]["Message"] == "The API name broken is invalid."
    assert "blank" in details[2]["Message"]
    results = {r["API Name"]: r for r in _rows(glob.glob(str(tmp_path / "api_precision_compare_result_*.csv"))[0])}
    assert results["broken"]["Forward Test Success"] == "SKIP"
    assert results["Functional.linear.0"]["Message"] == "This data type does not support benchmark compare."
    assert results["Functional.gelu.0"]["Forward Test Success"] == "SKIP"
