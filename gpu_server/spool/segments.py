"""Spool segment files: the on-disk format of accepted records (no pickle), written once, read back at restart.

    seg-000000042.spl   the magic `OCSPOOL1`, then per record:
                        `REC1`, header length (u32), payload length (u64), crc32 of the header (u32),
                        crc32 of the payload (u32)   -- little-endian, struct `<4sIQII`
                        the serialized `Record` (the wire header, `payload_bytes` included), the raw payload

A segment is written to `seg-N.spl.tmp`, fsync'ed and renamed; a failed write removes its temporary file.
Scanning validates the magic, each entry's lengths against the file and the limits, the header checksum and the
header's own `payload_bytes`. Damage in the middle of a segment does not hide the records after it: the scan
looks for the next entry whose header checksum holds and counts the bytes it skipped. The payload checksum is
verified when the record is read back.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import re
import stat
import struct

from gpu_server.atomic_file import write_atomic
from gpu_server.spool import direct_io
from gpu_server.spool.checksum import crc32
from protos import online_check_pb2 as pb
from protos.limits import Limits

MAGIC = b"OCSPOOL1"
ENTRY = struct.Struct("<4sIQII")
TAG = b"REC1"
SEGMENT_FILE = re.compile(r"^seg-([0-9]{9,})\.spl\Z")
KEPT_DIR = "kept"            # `--keep-records`: completely reported segments, moved here instead of deleted


@dataclasses.dataclass
class Entry:
    """Where one spooled record lies, and what its header says (for a SKIP row if its payload is damaged)."""

    key: tuple               # (run_id, rank, seq)
    segment: int
    offset: int              # of the header bytes
    header_len: int
    payload_len: int
    name: str = ""
    step: int = 0
    direction: int = 0


@dataclasses.dataclass
class Damage:
    segment: int
    offset: int
    skipped: int             # bytes that held no readable entry
    why: str


def segment_path(spool_dir: str, seg: int) -> str:
    return os.path.join(spool_dir, f"seg-{seg:09d}.spl")


def list_segments(spool_dir: str) -> list[int]:
    return sorted(int(m.group(1)) for m in map(SEGMENT_FILE.match, os.listdir(spool_dir)) if m)


def is_real_dir(path: str) -> bool:
    """A folder itself, not a link to one (lstat)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def segment_files(folder: str) -> list[tuple[int, str]]:
    """(number, path) of the segment files in `folder` that are regular files (lstat: a link is never followed),
    named exactly `seg-N.spl`; [] when `folder` is missing or not a folder itself."""
    if not is_real_dir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        m = SEGMENT_FILE.match(name)
        if not m:
            continue
        path = os.path.join(folder, name)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                found.append((int(m.group(1)), path))
        except OSError:
            continue
    return sorted(found)


def entry_bytes(header: bytes, payload) -> bytes:
    """The 24 bytes before a record's header."""
    return ENTRY.pack(TAG, len(header), len(payload), crc32(header), crc32(payload))


def write_segment(path: str, records: list[tuple[bytes, bytes | bytearray | memoryview]], fsync: bool) -> None:
    """Write (header, payload) pairs as one segment: temporary file, fsync, rename. Raises OSError, leaving no
    temporary file behind. A segment is read back only after a restart, so a durable one is written around the page
    cache where its file system allows (O_DIRECT, gpu_server/spool/direct_io.py), else through it, its pages
    dropped once durable (`write_atomic`'s `drop_cache`); the bytes are the same. docs/design.md §6.3 gives the
    measurements."""
    def write(fh) -> None:
        fh.write(MAGIC)
        for header, payload in records:
            fh.write(entry_bytes(header, payload))
            fh.write(header)
            fh.write(payload)

    if fsync:
        try:
            write_atomic(path, write, binary=True, fsync=True, opener=direct_io.open_direct)
            return
        except direct_io.Refused:
            pass   # nothing of it is left: written through the page cache below
    write_atomic(path, write, binary=True, fsync=fsync, drop_cache=True)


def _entry_at(data: bytes, pos: int, seg: int, limits: Limits) -> tuple[Entry | None, str]:
    """The entry starting at `pos`, or (None, why not)."""
    if pos + ENTRY.size > len(data):
        return None, f"entry header cut off at byte {pos}"
    tag, hlen, plen, hcrc, _pcrc = ENTRY.unpack_from(data, pos)
    if tag != TAG or hlen > limits.max_frame_bytes or plen > limits.max_record_bytes:
        return None, f"bad entry at byte {pos}"
    start = pos + ENTRY.size
    if start + hlen + plen > len(data):
        return None, f"entry at byte {pos} runs past the end of the file"
    header = bytes(data[start:start + hlen])
    if crc32(header) != hcrc:
        return None, f"entry at byte {pos}: header checksum mismatch"
    try:
        record = pb.Record.FromString(header)
    except Exception:  # noqa: BLE001 - a checksum collision on garbage: not an entry
        return None, f"entry at byte {pos}: header does not parse"
    if record.payload_bytes != plen:
        return None, f"entry at byte {pos}: payload length disagrees with the record"
    h = record.header
    return Entry((h.run_id, h.rank, h.seq), seg, start, hlen, plen, h.name, h.step, h.direction), ""


def scan_segment(seg: int, path: str, limits: Limits) -> tuple[list[Entry], list[Damage]]:
    """The entries of one segment and the damaged regions between them (resynchronising on the next entry)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return [], [Damage(seg, 0, 0, "empty file (not a spool segment)")]
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:   # segments can be large: not read
            return _scan(seg, data, limits)


def _scan(seg: int, data, limits: Limits) -> tuple[list[Entry], list[Damage]]:
    entries: list[Entry] = []
    damage: list[Damage] = []
    if data[:len(MAGIC)] != MAGIC:
        damage.append(Damage(seg, 0, 0, "not a spool segment (bad magic)"))
    pos = len(MAGIC)
    while pos < len(data):
        entry, why = _entry_at(data, pos, seg, limits)
        if entry is not None:
            entries.append(entry)
            pos = entry.offset + entry.header_len + entry.payload_len
            continue
        nxt = pos + 1
        while True:
            nxt = data.find(TAG, nxt)
            if nxt < 0 or _entry_at(data, nxt, seg, limits)[0] is not None:
                break
            nxt += 1
        end = len(data) if nxt < 0 else nxt
        damage.append(Damage(seg, pos, end - pos, why))
        pos = end
    return entries, damage


def read_entry(spool_dir: str, entry: Entry, payload: bytearray | None = None) -> tuple[pb.Record, bytearray]:
    """The spooled record and its payload, both checksums verified (the intake validates the rest)."""
    with open(segment_path(spool_dir, entry.segment), "rb") as fh:
        fh.seek(entry.offset - ENTRY.size)
        tag, hlen, plen, hcrc, pcrc = ENTRY.unpack(fh.read(ENTRY.size))
        if (tag, hlen, plen) != (TAG, entry.header_len, entry.payload_len):
            raise ValueError("spool entry moved")
        header = fh.read(hlen)
        data = payload if payload is not None else bytearray(plen)
        view = memoryview(data)
        got = 0
        while got < plen:
            n = fh.readinto(view[got:])
            if not n:
                raise ValueError("spool entry cut off")
            got += n
    if crc32(header) != hcrc:
        raise ValueError("spool entry header checksum mismatch")
    if crc32(data) != pcrc:
        raise ValueError("spool entry payload checksum mismatch")
    return pb.Record.FromString(header), data
