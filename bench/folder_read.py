#!/usr/bin/env python3
"""The folder reader's own cost: reading a recorded folder's records into whole payloads, with and without putting
each chunk's data straight into its place, side by side in one run.

    python bench/server.py --steps 2 --keep /tmp/rec      # once: a mid transformer's records, kept
    python bench/folder_read.py /tmp/rec [--rounds 3]

For every record file of every rank (in sequence order), the frames are read the way the folder intake reads them
(gpu_server/intake/folder.py `FolderReader._read_frames`, every size checked before it is read) and joined into
records (`FrameAssembler.feed`), as two variants alternating round by round on one core:

* whole frame: every frame read into a message of its own, its data then copied into the record (the path before
  `_read_in_place`, still taken for every frame that is not a chunk continuing a record);
* into place:  a chunk's data read from the file straight into the record's payload (`_read_in_place`).

No spool, no decoding, no replay: the files stay where they are. Prints CPU seconds, GiB/s and minor page faults of
the fastest round of each, and the ratio. End and batch frames are counted but not joined (they carry no chunks).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gpu_server.intake import folder as folder_mod  # noqa: E402
from gpu_server.intake.assembler import FrameAssembler  # noqa: E402
from gpu_server.intake.folder import FolderReader, _Dir  # noqa: E402
from protos.folder_format import RECORD_FILE  # noqa: E402

WHOLE = 1 << 62   # a HEAD_BYTES no frame exceeds: every frame read as a whole


def read_all(nfs: str, head_bytes: int) -> dict:
    """Join every record of the folder; the records, payload bytes, CPU seconds and minor faults it took."""
    folder_mod.HEAD_BYTES = head_bytes
    records = nbytes = 0
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for rank in sorted(os.listdir(nfs)):
        path = os.path.join(nfs, rank)
        names = sorted((int(m.group(3)), m.group(0)) for m in map(RECORD_FILE.match, os.listdir(path)) if m)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            reader = FolderReader(path, intake=types.SimpleNamespace(budget=None))
            for _, name in names:
                asm = FrameAssembler()
                try:
                    for frame, data, _left in reader._read_frames(_Dir(path, fd, rank), name, asm):
                        if frame.WhichOneof("body") not in ("record", "chunk"):
                            continue
                        done = asm.feed(frame, data)
                        if done is not None:
                            records += 1
                            nbytes += len(done[1])
                            del done
                finally:
                    asm.close()
        finally:
            os.close(fd)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return {"records": records, "bytes": nbytes, "cpu": cpu, "wall": t1 - t0, "faults": r1.ru_minflt - r0.ru_minflt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", help="a folder kept with bench/server.py --keep (its nfs/ subfolder is read)")
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args()
    nfs = os.path.join(ns.records, "nfs")
    if not os.path.isdir(nfs):
        sys.exit(f"{nfs} is not a folder: record one first with python bench/server.py --steps 2 --keep "
                 f"{ns.records}")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    variants = {"whole frame": WHOLE, "into place": folder_mod.HEAD_BYTES}
    best: dict[str, dict] = {}
    for _ in range(ns.rounds):
        for name, head in variants.items():
            r = read_all(nfs, head)
            if name not in best or r["cpu"] < best[name]["cpu"]:
                best[name] = r
    for name, r in best.items():
        print(f"{name:12s} {r['records']} records, {r['bytes'] / 2**30:.2f} GiB: CPU {r['cpu']:.2f} s "
              f"({r['bytes'] / 2**30 / r['cpu']:.2f} GiB/s), wall {r['wall']:.2f} s, minor faults {r['faults']}")
    a, b = best["whole frame"], best["into place"]
    if a["records"] != b["records"] or a["bytes"] != b["bytes"]:
        sys.exit("the two variants joined different records")
    print(f"into place / whole frame: CPU {b['cpu'] / a['cpu']:.2f}, minor faults {b['faults'] / a['faults']:.2f} "
          f"(fastest of {ns.rounds} rounds each)")


if __name__ == "__main__":
    main()
