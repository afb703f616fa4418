"""Writing a file whole or not at all: a temporary file beside it (`path + ".tmp"`), flushed, fsync'ed when asked,
then renamed over `path`. A reader never sees a partial file; on failure the temporary file is removed and the
error raised."""
from __future__ import annotations

import contextlib
import os
from typing import IO, Any, Callable


def write_atomic(path: str, write: Callable[[IO[Any]], object], binary: bool = False, fsync: bool = False) -> None:
    """`write(fh)` fills the temporary file (opened "wb", or "w" as UTF-8 text); it then replaces `path`."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8") as fh:
            write(fh)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
