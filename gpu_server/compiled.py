"""The server's compiled module (docs/design.md §6.2, "Records decoded in C"), built and loaded by
protos/compiled.py.

`_fastdecode.c` reads a record's header and values off its bytes (gpu_server.decode). Its pure-Python path gives the
same jobs; that path runs where the module is not built, where it fails to load, or with ONLINE_CHECK_PURE_PYTHON=1.

`python -m gpu_server.compiled --build` (scripts/setup.sh runs it) compiles it, a few seconds.
"""
from __future__ import annotations

import sys
from pathlib import Path

from protos.compiled import Compiled
from protos.compiled import main as _main

HERE = Path(__file__).parent
DECODE = Compiled("_fastdecode", "records are decoded in Python", HERE, "gpu_server")
ALL = (DECODE,)


def main(argv: list[str] | None = None) -> int:
    return _main(ALL, argv, "python -m gpu_server.compiled", "Build the server's compiled module.")


if __name__ == "__main__":
    sys.exit(main())
