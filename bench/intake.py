"""The server's intake of one record (validated, decoded, admitted) against the floor of that work, side by side.

    python bench/intake.py [--records 2000] [--rounds 7] [--baseline PATH]

What the receiving side of the wire spends on each complete record once its bytes are there: the Record parsed
from its bytes, then `Intake.submit` (gpu_server/intake/admission.py: run id, rank, duplicate check, name, every
tensor meta checked against the payload and the limits, every value decoded, the allowlist and argument checks,
the job built and dispatched), with a dispatch that only counts, as bench/transport.py's receiver. The floor: the
Record parsed and each of its tensors made from the payload (torch.frombuffer at its offset, reshaped), nothing
checked. Four kinds of record, as a training sends them (the agent's own encoding, npu_agent/records.py):

* relu 4 KiB:   one float32 input of 1,024 elements, no output (bench/transport.py's small record);
* relu:         input and output, 1,024 elements each;
* linear:       input (4, 64), weight (16, 64), bias (16), output (4, 16);
* layer_norm:   input (4, 64), normalized_shape (64,), weight, bias, eps as a keyword, output.

Each measure runs in a process of its own that stays up (one per source tree), and the rounds alternate between
them, the fastest round of each kept: the test VM's speed drifts by 10-30 % within minutes, which runs one after
the other would read as a change. `--baseline PATH` adds the same measures of the checkout at PATH (e.g. a
`git worktree add --detach /tmp/base <commit>` of the previous main), before/after printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from measuring import MeasuringProcess, in_turn  # (bench/measuring.py, beside this file)

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("relu 4 KiB", "relu", "linear", "layer_norm")


# ------------------------------------------------------------------------------------------ in the measuring process

def counting_intake():
    """An intake that counts the jobs it would check, under gpu-server's default memory budget (each job's bytes
    released at once, as a worker does once it checked it)."""
    from gpu_server.app import default_memory_budget
    from gpu_server.config import ServerConfig
    from gpu_server.intake.admission import Intake
    from gpu_server.intake.budget import ByteBudget

    counts = {"jobs": 0}
    budget = ByteBudget(default_memory_budget())

    def dispatch(job):
        counts["jobs"] += 1
        budget.release(job.reserved)
        job.reserved = 0

    return Intake(ServerConfig(), dispatch, budget=budget), counts, budget


def _calls(kind: str):
    """(name, args, kwargs, output or None) of one call of `kind`."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if kind in ("relu 4 KiB", "relu"):
        x = torch.randn(1024)
        return "Functional.relu", (x,), {}, F.relu(x) if kind == "relu" else None
    x, w, b = torch.randn(4, 64), torch.randn(16, 64), torch.randn(16)
    if kind == "linear":
        return "Functional.linear", (x, w, b), {}, F.linear(x, w, b)
    g, h = torch.randn(64), torch.randn(64)
    return "Functional.layer_norm", (x, (64,), g, h), {"eps": 1e-5}, F.layer_norm(x, (64,), g, h, eps=1e-5)


def _encoded(kind: str, n: int) -> list[tuple[bytes, bytes]]:
    """n records of `kind` as the agent writes them: (the Record's bytes, the payload)."""
    from npu_agent.records import PendingRecord, encode_record
    from npu_agent.snapshot import snapshot

    name, args, kwargs, out = _calls(kind)
    recs = []
    for i in range(n):
        rec = PendingRecord(name=f"{name}.{i}", step=0, inputs=snapshot((args, kwargs)),
                            output=snapshot(out) if out is not None else None, seq=i)
        enc = encode_record(rec, "bench", 0)
        recs.append((enc.serialized, b"".join(bytes(view) for _, view in enc.buffers)))
    return recs


def _intake_round(recs: list[tuple[bytes, bytes]]) -> float:
    """Seconds a record: parsed and submitted to a fresh intake (each record new to it)."""
    from protos import online_check_pb2 as pb
    intake, counts, _ = counting_intake()
    parse, submit = pb.Record.FromString, intake.submit
    t0 = time.perf_counter()
    for raw, payload in recs:
        submit(parse(raw), payload, 0, "bench")
    dt = time.perf_counter() - t0
    # a refused record is dispatched too, as its SKIP row: not a job
    taken = counts["jobs"] - intake.rejected - intake.not_replayable
    if taken != len(recs):
        raise RuntimeError(f"the intake took {taken} of {len(recs)} records: {intake.rejected} rejected, "
                           f"{intake.not_replayable} not replayable, {intake.duplicates} duplicates")
    return dt / len(recs)


def _floor_round(recs: list[tuple[bytes, bytes]]) -> float:
    """Seconds a record: parsed, and each tensor made from its bytes (nothing checked)."""
    import torch

    from protos import online_check_pb2 as pb
    from protos.codec import dtype_from_name

    parse = pb.Record.FromString
    t0 = time.perf_counter()
    for raw, payload in recs:
        for meta in parse(raw).tensors:
            dtype = dtype_from_name(meta.dtype)
            torch.frombuffer(payload, dtype=dtype, count=meta.nbytes // dtype.itemsize,
                             offset=meta.offset).reshape(tuple(meta.shape))
    return (time.perf_counter() - t0) / len(recs)


def serve(n: int) -> None:
    """The measuring process: one line per request ('<kind>'), answered with a JSON line of microseconds."""
    import warnings

    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    encoded = {kind: _encoded(kind, n) for kind in KINDS}
    for kind in KINDS:   # warm-up: first calls (lookups, caches a running server has warm already)
        _intake_round(encoded[kind][:50])
    print("READY", flush=True)
    for line in sys.stdin:
        kind = line.strip()
        recs = encoded[kind]
        print(json.dumps({"intake": _intake_round(recs) * 1e6, "floor": _floor_round(recs) * 1e6}), flush=True)


# ------------------------------------------------------------------------------------------------- the driver

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=2000, help="records of each kind a round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--baseline", metavar="PATH", help="the same measures of the checkout at PATH, alternating")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.serve:
        serve(ns.records)
        return 0
    trees = {"after": os.path.dirname(HERE)}
    if ns.baseline:
        trees = {"before": os.path.abspath(ns.baseline), **trees}
    measurers = {label: MeasuringProcess(__file__, root, ["--serve", "--records", str(ns.records)])
                 for label, root in trees.items()}
    best: dict[tuple[str, str], dict] = {}
    try:
        for m in measurers.values():   # both set up meanwhile
            m.ready()
        for r in range(ns.rounds):
            for kind in KINDS:
                for label in in_turn(list(measurers), r):
                    got = json.loads(measurers[label].ask(kind, "{"))
                    keep = best.setdefault((label, kind), dict(got))
                    for k, v in got.items():
                        keep[k] = min(keep[k], v)
    finally:
        for m in measurers.values():
            m.close()
    print(f"the server's intake of one record, us (the fastest of {ns.rounds} rounds of {ns.records} records, "
          "alternating); floor: the record parsed and its tensors made, nothing checked")
    print(f"{'record':12s} {'tree':7s} {'intake':>8s} {'floor':>8s} {'intake/floor':>13s}")
    for kind in KINDS:
        for label in measurers:
            b = best[(label, kind)]
            # two decimals: a floor of 4.5 us printed to one would move intake/floor read back by 1 %
            print(f"{kind:12s} {label:7s} {b['intake']:8.2f} {b['floor']:8.2f} {b['intake'] / b['floor']:13.2f}")
    if ns.baseline:
        print("ratios: after/before, intake time a record")
        for kind in KINDS:
            print(f"  {kind:12s} {best[('after', kind)]['intake'] / best[('before', kind)]['intake']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
