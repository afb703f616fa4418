"""The replay arenas' folder without room (docs/design.md §6.8): a container's /dev/shm is 64 MiB unless it is given
more, and a write into a mapped file that does not fit kills the writer with SIGBUS, the server itself for a
record's arena. The bytes are allocated first (posix_fallocate): a record or an answer that does not fit is that
call's SKIP row naming the folder and what to do, the server and its worker go on; a /dev/shm below 1 GiB is not
used at all (the system's temporary folder instead, said once)."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import tempfile

import pytest
import torch

from gpu_server.replay import shm_folder
from gpu_server.replay.answer_arenas import AnswerArenas
from gpu_server.replay.run import ReplayError
from gpu_server.replay.sandbox import ProcessReplayer, SandboxLimits
from gpu_server.replay.sandbox_wire import Arena, ArenaFull
from tests.support import forked_replay_workers  # noqa: F401 - its replay workers forked (an autouse fixture)
from tests.test_sandbox import MiB, frames_of, job_of


def _no_room(monkeypatch, folder: str) -> None:
    """posix_fallocate in `folder` fails as a full tmpfs makes it fail."""
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(folder):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)


def test_an_arena_that_does_not_fit_is_refused_with_what_to_do_and_leaves_no_file(monkeypatch):
    with tempfile.TemporaryDirectory() as folder:
        _no_room(monkeypatch, folder)
        arena = Arena(folder, "in")
        with pytest.raises(ArenaFull) as info:
            arena.reserve(3 * MiB)
        text = str(info.value)
        assert folder in text and "no room for 3 MiB" in text and "--shm-size" in text
        assert info.value.errno == errno.ENOSPC and not os.listdir(folder)
        monkeypatch.undo()
        assert len(arena.reserve(3 * MiB)) == 4 * MiB   # room again: a new arena
        arena.close()


def test_an_answer_arena_that_cannot_grow_is_named_gone():
    """The worker's side: the server maps the arena it held before; when growing it fails, the old file is gone
    all the same and the next answer names it, so that the server unmaps it."""
    with tempfile.TemporaryDirectory() as folder:
        ring = AnswerArenas(folder, "out")
        ring.reserve(10)
        ring.given(ring.name)
        ring.release([ring.name])
        with pytest.MonkeyPatch.context() as mp:
            _no_room(mp, folder)
            with pytest.raises(ArenaFull):
                ring.reserve(8 * MiB)
        assert ring.take_gone() == ["out-0"] and not os.listdir(folder)
        ring.reserve(8 * MiB)   # room again: a new arena, nothing named gone twice
        assert ring.take_gone() == [] and ring.name == "out-2"
        ring.close()


def test_a_record_without_room_is_skip_naming_the_folder_and_the_next_one_is_replayed(monkeypatch):
    big = job_of(frames_of("Functional.relu.0", torch.nn.functional.relu, torch.randn(1 << 20)))
    small = job_of(frames_of("Functional.relu.1", torch.nn.functional.relu, torch.randn(64), seq=1))
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), 1, 64 * MiB)
    try:
        with pytest.MonkeyPatch.context() as mp:
            _no_room(mp, proc.folder)
            with pytest.raises(ReplayError, match="shared-memory folder .* has no room for"):
                proc.forward(big, keep=False, match=True)
        assert proc.forward(small, keep=False, match=True).bench[0].shape == (64,)
        assert proc.forward(big, keep=False, match=True).bench[0].shape == (1 << 20,)
        assert proc.replaced == 0
    finally:
        proc.close()


@contextlib.contextmanager
def _small_tmpfs(mib: int):
    """A real tmpfs of `mib` MiB (mounting needs privileges: skipped without)."""
    with tempfile.TemporaryDirectory() as mnt:
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", mnt], capture_output=True,
                                  timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:   # no mount command
            pytest.skip(f"cannot mount a tmpfs here ({exc})")
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode(errors='replace').strip()[:100]})")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", mnt], capture_output=True)


def test_an_answer_without_room_in_a_real_small_tmpfs_is_skip_and_the_worker_goes_on(monkeypatch):
    """In a 10 MiB tmpfs: a call whose record fits (4 MiB) but whose answer does not (12 MiB: the float64 bench
    and the float32 same-dtype run of a 1M-element outer product) is SKIP naming the folder, where the worker was
    killed with SIGBUS before; the next call is replayed by the same worker."""
    with _small_tmpfs(10) as mnt:
        monkeypatch.setattr(shm_folder, "shm_parent", lambda: mnt)
        torch.manual_seed(0)
        x, y = torch.randn(1024), torch.randn(1024)
        outer = job_of(frames_of("Torch.outer.0", torch.outer, x, y))
        relu = job_of(frames_of("Functional.relu.1", torch.nn.functional.relu, torch.randn(256), seq=1))
        proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), 1, 64 * MiB)
        try:
            with pytest.raises(ReplayError, match=f"shared-memory folder {mnt}.* has no room for"):
                proc.forward(outer, keep=False, match=True)
            assert proc.forward(relu, keep=False, match=True).bench[0].shape == (256,)
            assert proc.replaced == 0
        finally:
            proc.close()


def test_a_small_dev_shm_is_left_for_the_temporary_folder_said_once(monkeypatch, caplog):
    with tempfile.TemporaryDirectory() as shm:
        class Small:
            f_blocks, f_frsize, f_bavail = 16384, 4096, 16384   # 64 MiB, a container's default

        real = os.statvfs
        monkeypatch.setattr(os, "statvfs", lambda p: Small() if p == shm else real(p))
        monkeypatch.setattr(shm_folder, "_said_small", False)
        with caplog.at_level(logging.WARNING, logger="gpu_server"):
            assert shm_folder.shm_parent(shm) is None
            assert shm_folder.shm_parent(shm) is None
        said = [r.getMessage() for r in caplog.records if "holds only 64 MiB" in r.getMessage()]
        assert len(said) == 1 and "--shm-size" in said[0]
        Small.f_blocks = 2 * shm_folder.MIN_SHM_BYTES // 4096
        assert shm_folder.shm_parent(shm) == shm
