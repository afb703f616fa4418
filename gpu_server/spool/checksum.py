"""The spool's checksum: CRC-32 with zlib's polynomial, exactly the value `zlib.crc32` gives (the segment format,
gpu_server/spool/segments.py, is the same whichever computes it).

Every accepted payload is checksummed once when it is spooled and again when it is read back after a restart. zlib
1.2.13, which Debian's Python links, does it at about 2.2 GB/s on this project's 2-core test machine: 2 s of the
spool thread's CPU for bench/server.py's 4.5 GB of records. Intel's ISA-L (the `isal` package, in the `fast` extra
that `scripts/setup.sh` installs) computes the same CRC with carry-less multiplication at about 12 GB/s, without the
interpreter lock. Where it is not installed, zlib's is used: the same values (tests/test_spool_checksum.py).
"""
from __future__ import annotations

import zlib
from typing import Callable

try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:   # the `fast` extra is not installed: zlib's, the same values
    _isal_crc32 = None

crc32: Callable[..., int] = _isal_crc32 if _isal_crc32 is not None else zlib.crc32
"""crc32(data[, value]) -> int, as zlib.crc32."""
