"""The replay worker's shared-memory folder (gpu_server/replay/shm_folder.py): a server killed with kill -9 leaves
its arenas in /dev/shm, and the next server frees them; nothing that is not such a folder of a dead server is
touched."""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time

from gpu_server.replay import shm_folder
from tests import support

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _owner_in_a_process(parent: str) -> tuple[subprocess.Popen, str]:
    """A process holding an OwnedFolder under `parent` (with a file in it, as an arena); returns it and the path."""
    code = ("import sys, time\nfrom gpu_server.replay.shm_folder import OwnedFolder\n"
            "f = OwnedFolder(sys.argv[1])\nopen(f.path + '/in-0', 'wb').write(b'x' * 4096)\n"
            "print(f.path, flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, parent], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    path = proc.stdout.readline().strip()
    assert path.startswith(os.path.join(parent, shm_folder.PREFIX)), path
    return proc, path


def _dead(path: str) -> bool:
    """Whether the owner lock of `path` is free (its owner is gone), or the folder is gone already."""
    try:
        fd = os.open(os.path.join(path, shm_folder.LOCK), os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_only_the_folders_of_dead_owners_are_swept(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gpu_server")
    parent = str(tmp_path)
    killed, killed_path = _owner_in_a_process(parent)
    alive, alive_path = _owner_in_a_process(parent)
    mine = shm_folder.OwnedFolder(parent)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        no_lock = tmp_path / (shm_folder.PREFIX + "older")        # an older server's folder: no owner lock
        no_lock.mkdir()
        target = tmp_path / "elsewhere"                             # a link named like ours, to a dead-looking folder
        target.mkdir()
        (target / shm_folder.LOCK).write_bytes(b"")
        os.symlink(target, tmp_path / (shm_folder.PREFIX + "link"))
        (tmp_path / (shm_folder.PREFIX + "file")).write_bytes(b"")  # a file named like ours
        assert _dead(killed_path) and not _dead(alive_path) and not _dead(mine.path)

        removed = shm_folder.sweep(parent)

        assert removed == [killed_path]
        assert "removed 1 replay folder(s)" in caplog.text and "left by a server that was killed" in caplog.text
        assert "1 folder(s) gpu-server-replay-* in" in caplog.text and "no owner lock" in caplog.text
        assert not os.path.exists(killed_path)
        for kept in (alive_path, mine.path, str(no_lock), str(target / shm_folder.LOCK),
                     str(tmp_path / (shm_folder.PREFIX + "link")), str(tmp_path / (shm_folder.PREFIX + "file"))):
            assert os.path.lexists(kept), kept
        assert os.path.exists(os.path.join(alive_path, "in-0"))
    finally:
        alive.kill()
        alive.wait()
        mine.close()
    assert not os.path.exists(mine.path)
    assert shm_folder.sweep(parent) == [alive_path]


def _folders_locked_by(pid: int) -> set[str]:
    """The replay folders whose owner lock process `pid` holds (/proc/locks: other tests' servers run meanwhile)."""
    inodes = set()
    with open("/proc/locks") as fh:
        for line in fh:
            f = line.split()   # "1: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode> 0 EOF" ("->" for waiters)
            if len(f) >= 6 and f[1] == "FLOCK" and f[4] == str(pid):
                inodes.add(int(f[5].rsplit(":", 1)[1]))
    parent = shm_folder.shm_parent() or "/tmp"
    held = set()
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        try:
            if name.startswith(shm_folder.PREFIX) and os.stat(os.path.join(path, shm_folder.LOCK)).st_ino in inodes:
                held.add(path)
        except OSError:
            continue
    return held


def test_a_server_killed_with_kill_9_has_its_shared_memory_freed_by_the_next(tmp_path):
    work = str(tmp_path)
    out = os.path.join(work, "out")
    first = support.Server(work, out=out).start()
    try:
        cfg = support.agent_config(os.path.join(work, "agent.json"), first.port)
        support.run_training(support.SMALL_TRAIN, cfg, timeout=180)
        deadline = time.time() + 60
        while not support.read_csv(out, "accuracy_checking_result") and time.time() < deadline:
            time.sleep(0.05)
        assert support.read_csv(out, "accuracy_checking_result"), "nothing was replayed"
        ours = _folders_locked_by(first.proc.pid)
        assert ours, "the server holds no replay folder"
        assert any(n.startswith("in-") for p in ours for n in os.listdir(p)), "no arena in the replay folder"
    finally:
        first.kill()   # SIGKILL: the server cannot remove its folder
    deadline = time.time() + 30
    while not all(_dead(p) for p in ours) and time.time() < deadline:   # its replay worker exits too
        time.sleep(0.05)
    # (another test's server starting meanwhile may sweep it first: any server starting frees it)
    assert all(_dead(p) for p in ours if os.path.exists(p)), "the killed server's folder is still locked"
    second = support.Server(work, port=first.port, out=out).start()
    try:
        assert not any(os.path.exists(p) for p in ours), "the next server left the dead one's shared memory"
    finally:
        assert second.stop() == 0
