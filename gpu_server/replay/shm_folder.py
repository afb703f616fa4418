"""The folder a replay worker process shares with the server (gpu_server/replay/sandbox.py), and the sweep of those a
killed server left behind.

The arenas in that folder live in /dev/shm: memory, not disk. A server stopped normally removes its folder; one
killed (kill -9, the out-of-memory killer, a power cut of the container) cannot, and its arenas (up to the largest
record it replayed) would hold the host's memory until a reboot. So each folder carries an owner lock: a file,
`owner.lock`, that its server holds `flock`ed for as long as the folder is in use. The kernel drops the lock when the
process dies, however it dies, and whichever pid namespace it ran in. Each server, as it makes its folders, removes
the ones of our name whose lock it can take: their owner is gone.

The lock file is made and locked under a temporary name, then renamed: an `owner.lock` is never seen unlocked while
its owner lives. What is swept: a real directory (not a link) named `gpu-server-replay-*`, owned by this user, with
an `owner.lock` whose lock is free. Anything else there is left alone (another user's, an older server's without a
lock file: it is said once in the log).
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile

log = logging.getLogger("gpu_server")

PREFIX = "gpu-server-replay-"
LOCK = "owner.lock"


SHM = "/dev/shm"
MIN_SHM_BYTES = 1 << 30   # below this, /dev/shm is a container's default (64 MiB) or close: the arenas go elsewhere
_said_small = False


def shm_parent(shm: str = SHM) -> str | None:
    """`shm` (/dev/shm: memory) when there is one holding at least MIN_SHM_BYTES, else the system's temporary folder
    (None): a container's /dev/shm is 64 MiB unless it is given more, and an arena that does not fit there could
    only be refused (sandbox_wire.ArenaFull). Said once in the log, with what to do."""
    global _said_small
    if not os.path.isdir(shm):
        return None
    try:
        st = os.statvfs(shm)
    except OSError:
        return shm
    total = st.f_blocks * st.f_frsize
    if total >= MIN_SHM_BYTES:
        return shm
    if not _said_small:
        _said_small = True
        log.warning("%s holds only %d MiB (a container's default is 64 MiB): the replay workers' arenas go to %s "
                    "instead (files: slower than memory); give the container more shared memory (docker run "
                    "--shm-size=4g, compose shm_size) for them to stay in %s", shm, total >> 20, tempfile.gettempdir(),
                    shm)
    return None


class OwnedFolder:
    """A new folder under `parent`, held by this process until `close()` (which removes it)."""

    def __init__(self, parent: str | None = None):
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
        self._fd = -1
        try:
            tmp = os.path.join(self.path, LOCK + ".new")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self._fd = fd
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, os.path.join(self.path, LOCK))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd >= 0:
            os.close(self._fd)   # the lock goes with it
            self._fd = -1


_swept: set[str | None] = set()


def sweep_once(parent: str | None) -> None:
    """`sweep(parent)` the first time a folder is made there in this process."""
    if parent not in _swept:
        _swept.add(parent)
        sweep(parent)


def sweep(parent: str | None = None) -> list[str]:
    """Remove the folders under `parent` that a server killed before it could left there. Returns their paths."""
    parent = parent or tempfile.gettempdir()
    removed, unowned = [], 0
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            unowned += 1
            continue
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue   # its server lives
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d replay folder(s) in %s left by a server that was killed (their shared memory is freed)",
                 len(removed), parent)
    if unowned:
        log.info("%d folder(s) %s* in %s have no owner lock (an older gpu-server's, or one being made): left alone; "
                 "remove them by hand when no gpu-server runs", unowned, PREFIX, parent)
    return removed
