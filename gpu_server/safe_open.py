"""Opening a file this process did not write: a regular file only, never through a link, never blocking.

The offline tools (gpu_server/tools/offline.py: report, summary, compare, recheck) and the readers they use
(gpu_server/reports/frame.py, gpu_server/reports/summary.py, gpu_server/reports/html.py) open files found in a folder
that
others may write to (an --out folder, a shared folder). Every such open goes through `open_regular`:

- `O_NOFOLLOW`: a symbolic link named like a report is refused, never followed (it could point anywhere);
- `O_NONBLOCK`: opening a FIFO (or a device) returns at once instead of waiting for a writer that never comes;
- then `fstat` on the open descriptor (no race with a rename): anything but a regular file (a FIFO, a socket, a
  device, a folder) is refused, and only then is O_NONBLOCK cleared for ordinary reads.

A path the user names on the command line (`compare -npu FILE`, `recheck --config FILE`) may be a link (a
Kubernetes ConfigMap is one): `named=True` resolves it once and opens what it points to under the same rules.

`read_json` and `csv_rows` / `check_csv` add the checks of the content: UTF-8; for JSON, a bounded size and
nesting; for CSV, a header with the required columns, every row with the header's number of fields, no field over
the csv module's limit (131072 characters; the server cuts its cells to 2000), and a last line that ends (a file cut
in the middle of a row is truncated).

Every refusal is a `FileRefused` (a ValueError): one line naming the path, what is wrong with it and what to do.
The offline tools print it and exit with status 2.
"""
from __future__ import annotations

import csv
import errno
import io
import json
import os
import stat
from typing import Any, BinaryIO, Iterator, Sequence

MAX_JSON_BYTES = 256 << 20      # a summary_{ts}.json or a config; a server's summary is a few MiB at most

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_NOT_REGULAR = "remove or rename it, or give a regular file (only regular files are read: a pipe or a device could " \
               "block or never end)"


class FileRefused(ValueError):
    """A file that is not read: not there, not a regular file, a link, or malformed. `str()` is one line."""

    def __init__(self, path: str, why: str, missing: bool = False) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why, self.missing = path, why, missing


def _a(what: str) -> str:
    return ("an " if what[:1].lower() in "aeiou" else "a ") + what


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _open_error(path: str, exc: OSError) -> FileRefused:
    if exc.errno == errno.ENOENT:
        return FileRefused(path, "no such file", missing=True)
    if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
        return FileRefused(path, "is a symbolic link; links found in a folder are not followed: replace it with the "
                                 "file it points to, or remove it")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return FileRefused(path, "cannot be read (permission denied): give this user read access to it")
    if exc.errno == errno.ENXIO:     # a socket, or a device without its driver
        try:
            return FileRefused(path, f"is {_kind(os.lstat(path).st_mode)}, not a regular file: {_NOT_REGULAR}")
        except OSError:
            pass
    return FileRefused(path, f"cannot be opened ({exc.strerror or exc})")


def open_regular(path: str, max_bytes: int | None = None, what: str = "file", named: bool = False) -> BinaryIO:
    """`path` opened for reading in binary, when it is a regular file and not a symbolic link; else `FileRefused`.
    Never blocks on a FIFO or a device. `max_bytes`: a larger file is refused (a `what` is never that large).
    `named`: the user named this path (a link is resolved once, its target opened under the same rules)."""
    target = os.path.realpath(path) if named else path
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(target, flags)
    except OSError as exc:
        raise _open_error(path, exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(path, f"is {_kind(st.st_mode)}, not a regular file: {_NOT_REGULAR}")
        if max_bytes is not None and st.st_size > max_bytes:
            raise FileRefused(path, f"{st.st_size} bytes, more than {_a(what)} can be ({max_bytes}): is it the right "
                                    "file?")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def create_regular(path: str) -> BinaryIO:
    """`path` created (or truncated) for writing in binary, never through a link and never blocking on a FIFO; an
    existing non-regular file there is refused."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
             | getattr(os, "O_NOCTTY", 0))
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise FileRefused(path, "is a symbolic link; it is not written through: remove it or choose another "
                                    "output folder") from None
        if exc.errno == errno.ENXIO:        # a FIFO without a reader
            raise FileRefused(path, f"is a FIFO (named pipe), not a regular file: {_NOT_REGULAR}") from None
        raise FileRefused(path, f"cannot be written ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileRefused(path, f"is {_kind(mode)}, not a regular file: {_NOT_REGULAR}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str, max_bytes: int, what: str = "file", named: bool = False) -> bytes:
    """The whole of a regular file of at most `max_bytes` (one that grows past it while read is refused too)."""
    with open_regular(path, max_bytes, what, named) as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileRefused(path, f"more than {_a(what)} can be ({max_bytes} bytes): is it the right file?")
    return data


def read_json(path: str, what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES, named: bool = False) -> Any:
    """The parsed JSON of a regular file; `FileRefused` naming the path for anything else (not UTF-8, not JSON,
    nested too deeply, too large)."""
    data = read_bytes(path, max_bytes, what, named)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileRefused(path, f"not UTF-8 text (byte {exc.start}): not {_a(what)}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileRefused(path, f"not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno}): a damaged or "
                                f"truncated {what}") from None
    except (ValueError, RecursionError) as exc:   # a number too long, nesting too deep
        raise FileRefused(path, f"not {_a(what)} ({type(exc).__name__}: {str(exc)[:120]})") from None


# -- CSV ---------------------------------------------------------------------------------------------------------
def _rows(fh: BinaryIO, path: str, what: str, hint: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, row) of an open CSV file (UTF-8, an optional BOM); malformed content is a `FileRefused`."""
    text = io.TextIOWrapper(fh, encoding="utf-8-sig", newline="")
    reader = csv.reader(text, strict=True)
    try:
        for row in reader:
            yield reader.line_num, row
    except UnicodeDecodeError as exc:
        raise FileRefused(path, f"not UTF-8 text ({exc.reason}): not {_a(what)}; {hint}") from None
    except csv.Error as exc:
        raise FileRefused(path, f"not a well-formed CSV file (line {reader.line_num}: {exc}); {hint}") from None
    finally:
        if not fh.closed:
            text.detach()     # the caller's file stays open


def _checked(fh: BinaryIO, path: str, what: str, required: Sequence[str], hint: str) -> Iterator[list[str]]:
    """The header, then the data rows (blank lines skipped), of an open CSV file, checked: not empty, not cut in
    the middle of a row, the `required` columns present, every row as long as the header."""
    size = os.fstat(fh.fileno()).st_size
    if size == 0:
        raise FileRefused(path, f"empty (not even a header line): not {_a(what)}; {hint}")
    fh.seek(size - 1)
    if fh.read(1) not in (b"\n", b"\r"):
        raise FileRefused(path, f"its last line is cut short (no line end): a truncated {what}; {hint}")
    fh.seek(0)
    rows = _rows(fh, path, what, hint)
    _, header = next(rows, (0, []))
    if not header or header == [""]:
        raise FileRefused(path, f"no header line: not {_a(what)}; {hint}")
    missing = [c for c in required if c not in header]
    if missing:
        raise FileRefused(path, f"no {', '.join(repr(c) for c in missing[:3])} column{'s' if len(missing) > 1 else ''}"
                                f" in its header: not {_a(what)}; {hint}")
    yield header
    n = len(header)
    for line, row in rows:
        if not row:
            continue
        if len(row) != n:
            raise FileRefused(path, f"a row ({len(row)} fields) does not match the header ({n} fields) near line "
                                    f"{line}: a damaged or truncated {what}; {hint}")
        yield row


_HINT = "restore it or move it out of the folder"


def check_csv(fh: BinaryIO, path: str, what: str = "CSV file", required: Sequence[str] = (),
              hint: str = _HINT) -> list[str]:
    """Check a whole CSV file (see `_checked`) without keeping its rows; its header. `fh` is left at its start (to
    hand it to a faster parser)."""
    rows = _checked(fh, path, what, required, hint)
    header = next(rows)
    for _ in rows:
        pass
    fh.seek(0)
    return header


def csv_rows(path: str, what: str = "CSV file", required: Sequence[str] = (), hint: str = _HINT,
             named: bool = False) -> tuple[list[str], list[dict[str, str]]]:
    """A regular CSV file's header and its rows as dicts by column title, checked (see `_checked`)."""
    with open_regular(path, what=what, named=named) as fh:
        rows = _checked(fh, path, what, required, hint)
        header = next(rows)
        return header, [dict(zip(header, row)) for row in rows]
