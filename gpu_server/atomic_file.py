"""Writing a file whole or not at all: a temporary file beside it (`path + ".tmp"`), flushed, fsync'ed when asked,
then renamed over `path`. A reader never sees a partial file; on failure the temporary file is removed and the
error raised."""
from __future__ import annotations

import contextlib
import os
from typing import IO, Any, Callable, Optional

_DONTNEED: int | None = getattr(os, "POSIX_FADV_DONTNEED", None)   # Linux and most Unixes; not macOS or Windows


def write_atomic(path: str, write: Callable[[IO[Any]], object], binary: bool = False, fsync: bool = False,
                 drop_cache: bool = False, opener: Optional[Callable[[str], Any]] = None) -> None:
    """`write(fh)` fills the temporary file (opened "wb", or "w" as UTF-8 text, or by `opener(tmp)`: a binary
    file-like object with write, flush, fileno and close, such as gpu_server/spool/direct_io.py's); it then replaces
    `path`.

    `drop_cache`: a file written once and not read again while the process runs (a spool segment, read back only
    after a restart): once fsync'ed, its pages are dropped from the page cache (`posix_fadvise(DONTNEED)`), so that
    the next file's pages are the memory just freed instead of memory the page cache takes anew. Only with `fsync`
    (dirty pages are not dropped) and where the call exists."""
    tmp = path + ".tmp"
    try:
        if opener is None:
            opener = (lambda p: open(p, "wb")) if binary else (lambda p: open(p, "w", encoding="utf-8"))
        with opener(tmp) as fh:
            write(fh)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
                if drop_cache and _DONTNEED is not None:
                    with contextlib.suppress(OSError):   # advice only: a file system that refuses it loses nothing
                        os.posix_fadvise(fh.fileno(), 0, 0, _DONTNEED)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
