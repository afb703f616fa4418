"""`gpu-server --keep-records` and `gpu-server recheck`: completely reported spool segments move into
`--out/spool/kept/` (never replayed by a restart), `recheck` reads the live and the kept segments (links never
followed, names strictly `seg-N.spl`), and a recheck of a cleanly drained real run (tests/report_run.py: a real
server, two real trainings, rank 0 with a faulty gelu kernel) gives the same rows as the run itself, flagging the
same calls, with the bench on `--device cpu`."""
from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

from tests import support
from tests.report_run import FAILING, faulty_out

GPU_SERVER = os.path.join(os.path.dirname(support.PY), "gpu-server")


def _record(seq: int, run: str = "run1", rank: int = 0, size: int = 64):
    from protos import online_check_pb2 as pb

    rec = pb.Record(header=pb.RecordHeader(run_id=run, rank=rank, step=0, seq=seq, name=f"Torch.abs.{seq}",
                                           direction=pb.FORWARD), payload_bytes=size)
    return rec, bytearray(bytes([seq % 256]) * size)


def _spool_with(out: str, done: range, live: range = range(0), keep: bool = True) -> None:
    """A real spool in `out` holding records `done` (completely reported) and `live` (not yet)."""
    from gpu_server.spool.store import Spool
    from protos import online_check_pb2 as pb

    sp = Spool(out, fsync=False, keep=keep)
    sp.open("20260101000000")
    for seq in list(done) + list(live):
        assert sp.append(*_record(seq)).wait(10)[0] == pb.Ack.ACCEPTED   # one segment each
    sp.complete([("run1", 0, s) for s in done], [], {})
    sp.close()


def _segments(folder: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "seg-*.spl")))


def _keys(spool_dir: str) -> set[tuple]:
    from gpu_server.spool.segments import list_segments, scan_segment, segment_path
    from protos.limits import DEFAULT_LIMITS

    keys = set()
    for seg in list_segments(spool_dir):
        keys |= {e.key for e in scan_segment(seg, segment_path(spool_dir, seg), DEFAULT_LIMITS)[0]}
    return keys


def test_kept_segments_are_never_replayed_and_their_numbers_stay_unique(tmp_path):
    from gpu_server.spool.store import Spool, SpoolError

    out = str(tmp_path / "out")
    spool, kept = os.path.join(out, "spool"), os.path.join(out, "spool", "kept")
    _spool_with(out, done=range(3))
    assert _segments(spool) == [] and len(_segments(kept)) == 3          # moved, not deleted
    sp = Spool(out, fsync=False, keep=True)
    rec = sp.open("x")
    assert rec.replay == [] and rec.done_count == 3                       # a restart never replays kept/
    sp.append(*_record(3)).wait(10)
    sp.complete([("run1", 0, 3)], [], {})
    sp.close()
    names = _segments(kept)
    assert len(names) == 4 and len(set(names)) == 4                      # the new segment did not overwrite one
    assert _keys(kept) == {("run1", 0, s) for s in range(4)}
    sizes = sum(os.path.getsize(os.path.join(kept, n)) for n in names)
    assert Spool(out, keep=True).kept_usage() == (4, sizes)
    sp = Spool(out, fsync=False)                                          # a start without --keep-records
    assert sp.open("x").replay == []
    sp.close()
    assert _segments(kept) == names                                       # leaves kept/ alone

    plain = str(tmp_path / "plain")
    _spool_with(plain, done=range(2), keep=False)
    assert _segments(os.path.join(plain, "spool")) == [] and not os.path.exists(os.path.join(plain, "spool", "kept"))

    linked = str(tmp_path / "linked")
    os.makedirs(os.path.join(linked, "spool"))
    os.symlink(str(tmp_path), os.path.join(linked, "spool", "kept"))
    with pytest.raises(SpoolError, match="not a folder"):
        Spool(linked, keep=True).open("x")


def test_recheck_copies_live_and_kept_segments_and_never_follows_links(tmp_path):
    from gpu_server.spool.segments import write_segment
    from gpu_server.tools.offline import copy_spooled_records

    out = str(tmp_path / "out")
    _spool_with(out, done=range(2), live=range(2, 3))                     # 2 kept, 1 still live
    kept = os.path.join(out, "spool", "kept")
    hostile = str(tmp_path / "hostile.spl")                               # records of another run, outside the spool
    header, payload = _record(0, run="hostile")
    write_segment(hostile, [(header.SerializeToString(), payload)], fsync=False)
    os.symlink(hostile, os.path.join(kept, "seg-000000900.spl"))         # a link: never followed
    with open(hostile, "rb") as fh:
        data = fh.read()
    for name in ("seg-00000090\u0660.spl", "seg-000000901.spl.x", "seg-000000902.spl\n"):   # not `seg-N.spl`
        with open(os.path.join(kept, name), "wb") as fh:
            fh.write(data)
    os.mkdir(os.path.join(kept, "seg-000000903.spl"))                     # not a regular file
    expected = {("run1", 0, s) for s in range(3)}
    assert copy_spooled_records(out, str(tmp_path / "a")) == 3
    assert _keys(str(tmp_path / "a" / "spool")) == expected
    with open(os.path.join(kept, "seg-000000904.spl"), "wb") as fh:      # the control: a regular, well-named file
        fh.write(data)
    assert copy_spooled_records(out, str(tmp_path / "b")) == 4
    assert _keys(str(tmp_path / "b" / "spool")) == expected | {("hostile", 0, 0)}
    os.rename(kept, kept + ".real")
    os.symlink(kept + ".real", kept)                                      # kept/ itself a link: left out
    assert copy_spooled_records(out, str(tmp_path / "c")) == 1
    assert _keys(str(tmp_path / "c" / "spool")) == {("run1", 0, 2)}


def _statuses(out_dir: str, rank: int) -> dict:
    rows = support.read_csv(out_dir, "api_precision_compare_result", rank)
    assert rows, f"no api_precision_compare_result rows for rank {rank} in {out_dir}"
    return {(r["API Name"], r["Step"]): (r["Forward Test Success"], r["Backward Test Success"]) for r in rows}


@pytest.mark.slow
def test_recheck_of_a_drained_keep_records_run_gives_the_same_rows(tmp_path):
    out = faulty_out()                                                    # the server ran with --keep-records
    kept = os.path.join(out, "spool", "kept")
    assert _segments(os.path.join(out, "spool")) == [], "the run did not drain"
    names = _segments(kept)
    sizes = {n: os.path.getsize(os.path.join(kept, n)) for n in names}
    assert names
    saved = json.load(open(glob.glob(os.path.join(out, "summary_*.json"))[0], encoding="utf-8"))
    assert saved["durability"]["spool_kept_bytes"] == sum(sizes.values())
    assert saved["durability"]["spool_kept_segments"] == len(names)
    new = str(tmp_path / "recheck")
    env = dict(os.environ, PYTHONPATH=support.ROOT, OMP_NUM_THREADS="1")   # as the run's server (report_run.py)
    proc = subprocess.run([GPU_SERVER, "recheck", out, "--device", "cpu", "-o", new], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    for rank in (0, 1):
        before, after = _statuses(out, rank), _statuses(new, rank)
        assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                                 if before.get(k) != after.get(k)}
    flagged = {(rank, name, int(step)) for rank in (0, 1) for (name, step), (fwd, _bwd) in _statuses(new, rank).items()
               if fwd == "error"}
    assert flagged == FAILING                                             # the faulty device's calls, again
    assert {n: os.path.getsize(os.path.join(kept, n)) for n in _segments(kept)} == sizes   # the old run untouched
