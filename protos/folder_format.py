"""The shared-folder transport's file names and file layout: the one place both sides take them from.

`npu_agent/transport_folder.py` writes, `gpu_server/intake/folder.py` reads (docs/design.md §5)::

    {nfs_path}/rank{r}/{run_id}.rank{r}.{seq:012d}.rec    one record: its Frames, exactly as on the gRPC stream;
                                                          or one Batch frame of records seq, seq+1, ...
    {nfs_path}/rank{r}/{run_id}.rank{r}.end               end of stream: one End Frame with the counts

A file is :data:`FOLDER_MAGIC`, then frames, each a 4-byte little-endian length (:data:`FRAME_LENGTH`) and one
serialized ``Frame``. Nothing in a file names a path; the names carry the run id, rank and sequence number.

The patterns accept exactly the names the builders make and nothing else: ASCII digits only (``[0-9]``, not
``\\d``, which matches other scripts' digits), anchored at both ends with ``\\Z`` (``$`` would accept a trailing
newline), no leading zeros in a rank, 12 digits of sequence number. ``parse_*(name)`` returns the fields or None,
and ``build(parse(name)) == name`` for every name that parses.
"""
from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Iterator

__all__ = ["FOLDER_MAGIC", "FRAME_LENGTH", "SEQ_DIGITS", "MAX_SEQ", "RUN_ID_PATTERN", "RANK_DIR", "RECORD_FILE",
           "END_FILE", "rank_dir_name", "folder_record_name", "folder_end_name", "parse_rank_dir",
           "parse_record_name", "parse_end_name", "file_chunks"]

#: The first 8 bytes of every record and end-marker file (the format's version is its last character).
FOLDER_MAGIC = b"OCFRAME1"
#: Each frame in a file is preceded by its length: unsigned 32-bit little-endian.
FRAME_LENGTH = struct.Struct("<I")
#: A sequence number is written with exactly this many digits, zero-padded.
SEQ_DIGITS = 12
MAX_SEQ = 10 ** SEQ_DIGITS - 1

#: A run id: 1 to 64 ASCII letters, digits, '_' or '-' (the agent's run ids are hex; protos.limits.RUN_ID agrees).
RUN_ID_PATTERN = r"[A-Za-z0-9_-]{1,64}"
_RANK = r"(0|[1-9][0-9]{0,8})"   # 0 .. 999999999, as str(int) writes it

# Groups: RANK_DIR (rank); RECORD_FILE (run_id, rank, seq); END_FILE (run_id, rank). `.match` and `.fullmatch`
# agree on these patterns (they end with \Z).
RANK_DIR = re.compile(rf"rank{_RANK}\Z", re.ASCII)
RECORD_FILE = re.compile(rf"({RUN_ID_PATTERN})\.rank{_RANK}\.([0-9]{{{SEQ_DIGITS}}})\.rec\Z", re.ASCII)
END_FILE = re.compile(rf"({RUN_ID_PATTERN})\.rank{_RANK}\.end\Z", re.ASCII)


def rank_dir_name(rank: int) -> str:
    """The folder under nfs_path that holds one rank's files: ``rank{r}``."""
    return f"rank{rank}"


def folder_record_name(run_id: str, rank: int, seq: int) -> str:
    """The file name of record `seq` of run `run_id` on `rank`: ``{run_id}.rank{r}.{seq:012d}.rec``."""
    return f"{run_id}.rank{rank}.{seq:0{SEQ_DIGITS}d}.rec"


def folder_end_name(run_id: str, rank: int) -> str:
    """The end-of-stream marker's file name: ``{run_id}.rank{r}.end``."""
    return f"{run_id}.rank{rank}.end"


def parse_rank_dir(name: str) -> int | None:
    """The rank of a folder named ``rank{r}``; None for any other name."""
    m = RANK_DIR.match(name)
    return int(m.group(1)) if m else None


def parse_record_name(name: str) -> tuple[str, int, int] | None:
    """(run_id, rank, seq) of a record file's name; None for any other name."""
    m = RECORD_FILE.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def parse_end_name(name: str) -> tuple[str, int] | None:
    """(run_id, rank) of an end marker's name; None for any other name."""
    m = END_FILE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def file_chunks(frames: Iterable[bytes]) -> Iterator[bytes]:
    """The bytes of one file, in pieces: the magic, then for each serialized frame its length and the frame."""
    yield FOLDER_MAGIC
    for frame in frames:
        yield FRAME_LENGTH.pack(len(frame))
        yield frame
