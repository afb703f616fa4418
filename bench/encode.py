"""The sender's encoding of small records into one Batch frame, side by side in one run, on one core.

    python bench/encode.py [--records 64] [--rounds 30] [--sizes 4k,64k]

For each size, 64 records of a relu call (input and output, each of that size / 2 bytes of float32) are encoded
and framed four ways, alternating round by round, the fastest round of each kept (training-thread CPU):
* together:      npu_agent.records.encode_together, each tensor copied once into the Batch frame (what the sender
                 does);
* alone, joined: each record encoded alone into its own payload (npu_agent.records.encode_record), then the
                 payloads joined into the frame (protos.framing.encode_batch): one copy more, and each payload
                 allocated;
* together, Python walk: the same with the record's values and tensor table written in Python
                 (npu_agent.records.PythonWalk), as where npu_agent/_fastencode.c is not built;
* floor:         each tensor's bytes memmoved into one preallocated buffer, nothing else: the copy itself.
It prints microseconds per record and the ratios to the floor. Both encodings give the same bytes
(tests/test_batching.py).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from npu_agent import records  # noqa: E402
from npu_agent.records import PendingRecord, batch_frame, encode_record, encode_together  # noqa: E402
from npu_agent.snapshot import iter_tensors, snapshot  # noqa: E402


def _records(n: int, numel: int) -> list[PendingRecord]:
    x = torch.randn(numel)
    y = torch.relu(x)
    return [PendingRecord(name=f"Functional.relu.{i}", step=0, inputs=snapshot(((x,), {})), output=snapshot(y),
                          seq=i) for i in range(n)]


def _together(recs: list[PendingRecord]) -> bytes | None:
    assert encode_together(recs, "bench", 0)
    return batch_frame([rec.encoded for rec in recs if rec.encoded is not None])


def _alone(recs: list[PendingRecord]) -> bytes | None:
    return batch_frame([encode_record(rec, "bench", 0) for rec in recs])


def _in_python(way):
    """`way` with the record's values written by the Python walk (records.PythonWalk), as without the compiled
    module (npu_agent/_fastencode.c)."""
    def run(recs: list[PendingRecord]) -> bytes | None:
        with records.walking(records.PythonWalk):
            return way(recs)
    return run


def _floor(recs: list[PendingRecord]) -> bytes | None:
    tensors = [t for rec in recs for s in (rec.inputs, rec.output) if s is not None for t in iter_tensors(s.tree)]
    out = bytearray(sum(t.nbytes for t in tensors))
    base = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
    at = 0
    for t in tensors:
        ctypes.memmove(base + at, t.data_ptr(), t.nbytes)
        at += t.nbytes
    return None


WAYS = {"together": _together, "together, Python walk": _in_python(_together), "alone, joined": _alone,
        "floor": _floor}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--sizes", default="4k,64k", help="bytes per record (k: KiB)")
    ns = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    print(f"{ns.records} records a frame, the fastest of {ns.rounds} rounds each, alternating; us per record")
    for size in ns.sizes.split(","):
        nbytes = int(size[:-1]) * 1024 if size.endswith("k") else int(size)
        best = dict.fromkeys(WAYS, float("inf"))
        for r in range(ns.rounds):
            order = list(WAYS.items()) if r % 2 == 0 else list(WAYS.items())[::-1]
            for name, way in order:
                recs = _records(ns.records, nbytes // 8)
                t0 = time.thread_time()
                way(recs)
                best[name] = min(best[name], (time.thread_time() - t0) / ns.records * 1e6)
        line = "   ".join(f"{k} {v:6.1f}" for k, v in best.items())
        print(f"  {size:>4}: {line}")
        print(f"        together/floor {best['together'] / best['floor']:.2f}   Python walk/floor "
              f"{best['together, Python walk'] / best['floor']:.2f}   alone/floor "
              f"{best['alone, joined'] / best['floor']:.2f}   together/alone "
              f"{best['together'] / best['alone, joined']:.2f}   compiled/Python "
              f"{best['together'] / best['together, Python walk']:.2f}")


if __name__ == "__main__":
    main()
