"""A fixed run whose reports must not change under a refactor (issue 24: "compare the CSVs of a fixed run before
and after, byte for byte apart from timestamps").

    python -m tests.report_identity run OUT        # the fixed run; its CSVs, timestamps taken out, into OUT
    python -m tests.report_identity compare A B    # every file of A and B byte for byte; exit 1 on a difference

The run: a real gpu-server over gRPC with two TinyLM bfloat16 trainings on the second device (tests/second_device.py,
a correct device that rounds differently), rank 0 with the faulty gelu forward kernel and rank 1 with the faulty
layer_norm backward kernel, two steps each; then a server over the shared folder with one training on the second
device and the faulty add kernel. One worker, one thread, so rows come in one order. What is taken out: the
timestamp in each report's file name, and nothing else (the CSV rows carry no time).

To compare against another checkout (the previous main), run `run` from that checkout's root with
`PYTHONPATH=<checkout>` so its packages are imported rather than the installed ones."""
from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile

TS = re.compile(r"_\d{8}\d*(?=[_.])")   # report_files: <kind>_<YYYYmmddHHMMSS>[_rank<r>].csv


def _collect(out: str, dest: str, prefix: str) -> int:
    n = 0
    for name in sorted(os.listdir(out)):
        if name.endswith(".csv"):
            shutil.copyfile(os.path.join(out, name), os.path.join(dest, prefix + TS.sub("", name, count=1)))
            n += 1
    return n


def run(dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="report-identity-") as work:   # the servers' records, spools and logs
        _run_in(work, dest)


def _run_in(work: str, dest: str) -> None:
    from tests import support
    from tests.faulty_kernels import run_trainings

    common = ["--model", "tinylm", "--dtype", "bfloat16", "--steps", "2", "--second-device"]

    server = support.Server(work, args=["--workers", "1"]).start()
    try:
        config = support.agent_config(os.path.join(work, "agent.json"), server.port)
        run_trainings(config, [common + ["--case", "gelu_forward"], common + ["--case", "layer_norm_backward"]])
    finally:
        code = server.stop()
    assert code == 0, server.log()
    grpc_files = _collect(server.out, dest, "grpc-")

    folder = os.path.join(work, "shared")
    os.makedirs(folder)
    fwork = os.path.join(work, "folder")
    os.makedirs(fwork)
    fserver = support.Server(fwork, nfs_path=folder, args=["--workers", "1"]).start()
    try:
        config = support.agent_config(os.path.join(fwork, "agent.json"), nfs_path=folder)
        run_trainings(config, [common + ["--case", "add_ulp"]])
    finally:
        code = fserver.stop()
    assert code == 0, fserver.log()
    folder_files = _collect(fserver.out, dest, "folder-")
    print(f"{grpc_files} gRPC and {folder_files} shared-folder report files in {dest}")


def compare(a: str, b: str) -> int:
    names_a, names_b = set(os.listdir(a)), set(os.listdir(b))
    bad = [f"only in {a}: {n}" for n in sorted(names_a - names_b)]
    bad += [f"only in {b}: {n}" for n in sorted(names_b - names_a)]
    same = sorted(names_a & names_b)
    for name in same:
        if not filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False):
            bad.append(f"differs: {name}")
    rows = sum(sum(1 for _ in open(os.path.join(a, n), encoding="utf-8")) for n in same)
    for line in bad:
        print(line)
    print(f"{len(same)} files, {rows} lines compared: {'identical' if not bad else f'{len(bad)} differences'}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    if args.cmd == "run":
        run(args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
