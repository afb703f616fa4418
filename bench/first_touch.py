#!/usr/bin/env python3
"""What a page of new memory costs on this machine, the first time it is written, side by side in one run.

    python bench/first_touch.py [--gib 4] [--idle 10]

Maps `--gib` GiB of anonymous memory and writes one byte per 4 KiB page, three times: first, again at once (the
pages just given back are handed out again: the floor, the kernel finding and zeroing a page), and again after
`--idle` seconds of doing nothing. On a virtual machine whose hypervisor takes free memory back (most likely
virtio-balloon free page reporting: the driver is loaded on this project's 2-core VM), pages that stayed free a
while must come back from the host first. On that VM, in one run each: 2 GiB cost 1.6 us a page all three times;
4 GiB 21.9 us first, 1.6 us at once, 11.2 us after 10 s; 8 GiB 24.6, 12.4 and 24.7 us. About 2-4 GiB of it is
kept backed; beyond that, a new page costs 10-25 us, 3-6 s a GiB.

This is the cost behind the training thread's page faults and the sender's writes into new record files in
`bench/overhead.py --agent-alone` (docs/design.md, "Holding the training's tensors by reference"): memory the
agent keeps for a while makes the training touch new pages, and a shared folder that no server empties takes new
pages for every file. It prints microseconds a page and the ratios to the floor.
"""
from __future__ import annotations

import argparse
import mmap
import resource
import time

PAGE = 4096


def touch(nbytes: int) -> tuple[float, float]:
    """(wall seconds, system CPU seconds) to write one byte in each page of `nbytes` of new anonymous memory."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    t0 = time.perf_counter()
    m = mmap.mmap(-1, nbytes)
    try:
        for off in range(0, nbytes, PAGE):
            m[off] = 1
        wall = time.perf_counter() - t0
    finally:
        m.close()
    return wall, resource.getrusage(resource.RUSAGE_SELF).ru_stime - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="memory to touch each time (GiB)")
    p.add_argument("--idle", type=float, default=10.0, help="seconds to wait before the third time")
    ns = p.parse_args()
    nbytes = int(ns.gib * (1 << 30)) // PAGE * PAGE
    pages = nbytes // PAGE
    first = touch(nbytes)
    again = touch(nbytes)
    time.sleep(ns.idle)
    later = touch(nbytes)
    print(f"first write of each page of {ns.gib:g} GiB of new memory, {pages} pages")
    for label, (wall, sys_cpu) in (("first", first), ("again at once (the floor)", again),
                                   (f"again after {ns.idle:g} s idle", later)):
        print(f"  {label:28s} {wall:7.2f} s  {wall / pages * 1e6:6.2f} us a page  (system CPU {sys_cpu:.2f} s)")
    print(f"ratios to the floor: first {first[0] / again[0]:.1f}, after {ns.idle:g} s idle {later[0] / again[0]:.1f}")


if __name__ == "__main__":
    main()
