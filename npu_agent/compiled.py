"""The agent's compiled modules (docs/design.md §4, "Skipped calls in C", "The frame walk in C" and "A captured
call's arguments read in C"; §5, "Values encoded in C"), built and loaded by protos/compiled.py.

`_fastskip.c` answers the calls the sampling skips (npu_agent.fastskip), `_fastencode.c` writes a record's values
and tensor table (npu_agent.records), `_fastlocate.c` finds the modules on a captured call's stack
(npu_agent.location), `_fasttap.c` reads a captured call's flat arguments (npu_agent.snapshot, npu_agent.backward)
and checks a known tree of autograd nodes against its inputs (npu_agent.backward), `_fasthook.cpp` (C++ against
torch) puts the backward taps' hooks on autograd nodes (npu_agent.backward), `_fastmask.cpp` (C++ against torch)
checks whether a dropout's keep-mask can be read off its output and reads a generator state's bytes
(npu_agent.capture). Each has a pure-Python path that gives the same records; that path runs where the module is not
built, where it fails to load, or with ONLINE_CHECK_PURE_PYTHON=1.

`python -m npu_agent.compiled --build` (scripts/setup.sh runs it) compiles them all, about 35 s.
"""
from __future__ import annotations

import sys
from pathlib import Path

from protos.compiled import PURE_PYTHON_ENV as PURE_PYTHON_ENV
from protos.compiled import Compiled
from protos.compiled import main as _main

HERE = Path(__file__).parent
SKIP = Compiled("_fastskip", "skipped calls are answered in Python", HERE, "npu_agent")
ENCODE = Compiled("_fastencode", "records are encoded in Python", HERE, "npu_agent")
LOCATE = Compiled("_fastlocate", "module paths are read off the frames in Python", HERE, "npu_agent")
TAP = Compiled("_fasttap", "a captured call's arguments are read in Python", HERE, "npu_agent")
HOOK = Compiled("_fasthook", "autograd hooks are put on through torch's Python registration", HERE, "npu_agent",
                torch=True)
MASK = Compiled("_fastmask", "a random call's dropout check and generator state are read in Python", HERE, "npu_agent",
                torch=True)
ALL = (SKIP, ENCODE, LOCATE, TAP, HOOK, MASK)


def main(argv: list[str] | None = None) -> int:
    return _main(ALL, argv, "python -m npu_agent.compiled", "Build the agent's compiled modules.")


if __name__ == "__main__":
    sys.exit(main())
