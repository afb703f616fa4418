"""Folder mode on the agent side never follows a symbolic link (issue 11, "Symlinks"): whoever can write to the
shared folder could plant one where the agent writes, to have it overwrite a file of the user running the training.
Real folders, real links, the real Sender and FolderTransport."""
from __future__ import annotations

import logging
import os
import time

from npu_agent import transport_folder
from npu_agent.sender import Sender
from npu_agent.transport_folder import FolderTransport, open_rank_dir, publish
from protos.codec import FOLDER_MAGIC, folder_record_name
from tests.test_folder import make_record

RUN = "symlinks"


def victim(tmp_path):
    path = tmp_path / "home" / "precious.txt"
    path.parent.mkdir()
    path.write_text("the user's own file")
    return path


def test_a_planted_temporary_link_is_never_written_through(tmp_path, monkeypatch):
    precious = victim(tmp_path)
    folder = tmp_path / "nfs" / "rank0"
    folder.mkdir(parents=True)
    name = folder_record_name(RUN, 0, 0)
    monkeypatch.setattr(transport_folder.secrets, "token_hex", lambda n: "predicted")
    planted = folder / f".{name}.{os.getpid()}.predicted.tmp"
    planted.symlink_to(precious)
    fd = open_rank_dir(str(folder))
    try:
        try:
            publish(fd, name, [b"frame"])
            raise AssertionError("publish wrote through a planted link")
        except FileExistsError:
            pass
    finally:
        os.close(fd)
    assert precious.read_text() == "the user's own file"
    assert planted.is_symlink() and not (folder / name).exists()


def test_the_transport_writes_around_a_planted_link_and_loses_nothing(tmp_path, monkeypatch):
    precious = victim(tmp_path)
    nfs = tmp_path / "nfs"
    (nfs / "rank0").mkdir(parents=True)
    names = iter(["predicted", "fresh0", "fresh1", "fresh2", "fresh3"])
    monkeypatch.setattr(transport_folder.secrets, "token_hex", lambda n: next(names))
    name = folder_record_name(RUN, 0, 0)
    (nfs / "rank0" / f".{name}.{os.getpid()}.predicted.tmp").symlink_to(precious)
    # the temporary name of the code before this fix, and a link at a final name
    (nfs / "rank0" / f".{name}.{os.getpid()}.tmp").symlink_to(precious)
    (nfs / "rank0" / folder_record_name(RUN, 0, 1)).symlink_to(precious)
    transport = FolderTransport(str(nfs), RUN, 0, 1, max_retry_s=0.05)
    sender = Sender(transport, budget_bytes=64 << 20)
    for i in range(2):   # one at a time: each record its own file (records that queue up would share one)
        assert sender.submit(make_record(i))
        deadline = time.monotonic() + 30
        while sender.counts.acknowledged <= i and time.monotonic() < deadline:
            time.sleep(0.001)
    counts = sender.close(timeout=30)
    assert counts["acknowledged"] == 2 and counts["unacknowledged"] == 0, counts
    assert precious.read_text() == "the user's own file"
    for seq in range(2):
        record = nfs / "rank0" / folder_record_name(RUN, 0, seq)
        assert not record.is_symlink() and record.read_bytes().startswith(FOLDER_MAGIC)


def test_a_symlinked_rank_folder_is_refused_once_and_capture_stops(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    (nfs / "rank0").symlink_to(elsewhere, target_is_directory=True)
    transport = FolderTransport(str(nfs), RUN, 0, 1, max_retry_s=0.05)
    sender = Sender(transport, budget_bytes=64 << 20)
    with caplog.at_level(logging.WARNING, logger="npu_agent"):
        assert sender.submit(make_record(0))
        deadline = time.monotonic() + 10
        while sender.refusal is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sender.refusal is not None and "symbolic link" in sender.refusal.cause
        assert not sender.submit(make_record(1)), "after a refusal nothing is held"
        t0 = time.monotonic()
        counts = sender.close(timeout=600)
        assert time.monotonic() - t0 < 5
    assert os.listdir(elsewhere) == [], "nothing was written through the link"
    assert counts["dropped"] == 2 and counts["unacknowledged"] == 0, counts
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "Fix: remove the link" in errors[0].getMessage(), caplog.text
    assert "cannot write" not in caplog.text
