"""The sender's encoding of small records into one Batch frame, side by side in one run, on one core.

    python bench/encode.py [--records 64] [--rounds 30] [--sizes 4k,64k]
    python bench/encode.py --strided [--rounds 30]

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

`--strided`: the copy of one tensor that is not contiguous (a transpose, attention's heads, a slice of a fused qkv
output, k transposed for q @ k^T) into a payload, three ways, alternating round by round, the fastest of each kept
(wall time; one core, one torch thread):
* compiled:      its elements gathered straight into the payload (npu_agent/_fastencode.c `gather`, what the
                 compiled walk's copy does);
* Python:        `.contiguous()`, then that copy memmoved into the payload (npu_agent.payload `Spans.copy` without
                 the compiled module, and before it gathered);
* floor:         the same number of bytes memmoved from a contiguous tensor.
Both give the same bytes (tests/test_fastencode.py).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from measuring import in_turn  # noqa: E402  (bench/measuring.py, beside this file)

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


def _strided_tensors() -> dict[str, torch.Tensor]:
    return {"transpose 2048x2048 float32": torch.randn(2048, 2048).t(),
            "transpose 512x512 float32": torch.randn(512, 512).t(),
            "transpose 4096x1024 bfloat16": torch.randn(4096, 1024).to(torch.bfloat16).t(),
            "heads [8,128,8,64] -> [8,8,128,64]": torch.randn(8, 128, 8, 64).transpose(1, 2),
            "qkv slice [8,128,1536][..., :512]": torch.randn(8, 128, 3 * 512)[..., :512],
            "k^T [8,8,128,64] -> [8,8,64,128]": torch.randn(8, 8, 128, 64).transpose(-2, -1),
            "transpose 64x64 float32": torch.randn(64, 64).t()}


def _copies(t: torch.Tensor, nbytes: int, addr: int, gather) -> dict:
    """The three ways of `--strided` to copy `t` to addr."""
    from npu_agent.payload import Region

    dense = t.contiguous()
    return {"compiled": lambda: Region(addr, nbytes, None).copy(0, nbytes, t, gather),
            "Python": lambda: Region(addr, nbytes, None).copy(0, nbytes, t),
            "floor": lambda: ctypes.memmove(addr, dense.data_ptr(), nbytes)}


def strided(rounds: int) -> None:
    """The `--strided` measures (module docstring)."""
    walk = records.walker()
    gather = getattr(walk, "gather", None)
    if gather is None:
        sys.exit("bench/encode.py --strided: npu_agent/_fastencode.c is not built (scripts/setup.sh builds it)")
    print(f"one tensor copied into a payload, the fastest of {rounds} rounds each, alternating; us per tensor")
    for name, t in _strided_tensors().items():
        nbytes = t.numel() * t.element_size()
        out = bytearray(nbytes)
        ways = _copies(t, nbytes, ctypes.addressof((ctypes.c_char * nbytes).from_buffer(out)), gather)
        best = dict.fromkeys(ways, float("inf"))
        for r in range(rounds):
            for way in in_turn(list(ways), r):
                t0 = time.perf_counter()
                ways[way]()
                best[way] = min(best[way], (time.perf_counter() - t0) * 1e6)
        line = "   ".join(f"{k} {v:8.1f}" for k, v in best.items())
        print(f"  {name:36s} {nbytes >> 10:6d} KiB   {line}   compiled/floor {best['compiled'] / best['floor']:.2f}"
              f"   Python/floor {best['Python'] / best['floor']:.2f}   compiled/Python "
              f"{best['compiled'] / best['Python']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--sizes", default="4k,64k", help="bytes per record (k: KiB)")
    p.add_argument("--strided", action="store_true", help="the copy of one strided tensor (module docstring)")
    ns = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    if ns.strided:
        strided(ns.rounds)
        return
    print(f"{ns.records} records a frame, the fastest of {ns.rounds} rounds each, alternating; us per record")
    for size in ns.sizes.split(","):
        nbytes = int(size[:-1]) * 1024 if size.endswith("k") else int(size)
        best = dict.fromkeys(WAYS, float("inf"))
        for r in range(ns.rounds):
            for name in in_turn(list(WAYS), r):
                recs = _records(ns.records, nbytes // 8)
                t0 = time.thread_time()
                WAYS[name](recs)
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
