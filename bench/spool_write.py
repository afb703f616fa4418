"""Writing spool segments, side by side in one run: around the page cache (O_DIRECT), through it, and the floor.

    python bench/spool_write.py [--gib 2] [--dir /path/on/the/spool's/disk] [--rounds 2]

Writes `--gib` GiB of records (8 MiB payloads from an anonymous mapping, as the intake joins them; 4 records a
segment) with `gpu_server.spool.segments.write_segment`, fsync'ed as the server does, into `--dir` (default: a
temporary folder under /tmp). Variants, alternating each round:

* direct:   the server's default where the file system takes O_DIRECT (gpu_server/spool/direct_io.py);
* buffered: through the page cache, its pages dropped once durable (what a file system without O_DIRECT gets);
* floor:    the checksums alone (`crc32` of every payload, which both variants compute first).

Each variant's best round: wall seconds and CPU seconds of this process (user + system). Prints last the ratios of
direct and buffered to the floor, in CPU.
"""
from __future__ import annotations

import argparse
import mmap
import os
import resource
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gpu_server.spool import direct_io  # noqa: E402
from gpu_server.spool.checksum import crc32  # noqa: E402
from gpu_server.spool.segments import write_segment  # noqa: E402
from protos import online_check_pb2 as pb  # noqa: E402

PAYLOAD = 8 << 20
PER_SEGMENT = 4


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _records(n: int) -> list[tuple[bytes, memoryview]]:
    block = mmap.mmap(-1, PAYLOAD)
    block.write(os.urandom(1 << 20) * (PAYLOAD >> 20))
    out = []
    for seq in range(n):
        header = pb.Record(header=pb.RecordHeader(run_id="bench", rank=0, step=0, seq=seq, name=f"Torch.add.{seq}",
                                                  direction=pb.FORWARD), payload_bytes=PAYLOAD).SerializeToString()
        out.append((header, memoryview(block)))
    return out


def _round(variant: str, folder: str, records: list) -> tuple[float, float]:
    t, c = time.perf_counter(), _cpu()
    saved = direct_io.O_DIRECT
    if variant == "buffered":
        direct_io.O_DIRECT = 0
    try:
        for i in range(0, len(records), PER_SEGMENT):
            batch = records[i:i + PER_SEGMENT]
            if variant == "floor":
                for _h, p in batch:
                    crc32(p)
                continue
            path = os.path.join(folder, f"seg-{i:09d}.spl")
            write_segment(path, batch, fsync=True)
            os.unlink(path)
    finally:
        direct_io.O_DIRECT = saved
    return time.perf_counter() - t, _cpu() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default="")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="spool-bench-", dir=args.dir or None)
    try:
        probe = os.path.join(folder, "probe")
        try:
            direct_io.open_direct(probe).close()
        except direct_io.Refused as exc:
            print(f"note: {folder}'s file system refuses O_DIRECT ({exc}): 'direct' goes through the page cache")
        records = _records(int(args.gib * (1 << 30)) // PAYLOAD)
        best: dict[str, tuple[float, float]] = {}
        for r in range(args.rounds):
            for variant in ("direct", "buffered", "floor"):
                wall, cpu = _round(variant, folder, records)
                print(f"round {r + 1} {variant:8s} wall {wall:6.2f} s  cpu {cpu:6.2f} s")
                old = best.get(variant)
                best[variant] = (min(wall, old[0]), min(cpu, old[1])) if old else (wall, cpu)
        gib = len(records) * PAYLOAD / (1 << 30)
        print(f"\n{gib:.1f} GiB in {len(records) // PER_SEGMENT} segments, best of {args.rounds} rounds:")
        for variant, (wall, cpu) in best.items():
            print(f"  {variant:8s} wall {wall:6.2f} s  cpu {cpu:6.2f} s")
        floor = best["floor"][1]
        print(f"cpu / floor: direct x{best['direct'][1] / floor:.2f}, buffered x{best['buffered'][1] / floor:.2f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
