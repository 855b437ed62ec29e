"""A JSON object in a file that several processes add entries to: the tuning cache (kernels/autotune.py) and the
benchmark's kept TileGym searches (bench/peer_tuning.py).

Writers take an exclusive lock on `<file>.lock` (the filelock package: flock on POSIX, msvcrt on Windows),
reread the file, set their entry and replace the file with a complete new one by rename. So readers never see
half a file, and two processes storing at once both keep their entries: without the lock, each would write back
what it read plus its own entry, and the later rename would drop the other's (several GPUs tuning side by side,
or the bench's workers with --gpus). A writer waits at most LOCK_TIMEOUT_S for the lock, then raises
LockTimeout naming the lock file: a hung process (or a lock on a network file system that never clears) would
otherwise hang every later writer without a word.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Callable

import filelock

# Seconds a writer waits for the lock. A holder keeps it only to read, merge and rewrite the file (milliseconds),
# so reaching this means a holder that is stuck, not busy.
LOCK_TIMEOUT_S = 60.0


class LockTimeout(TimeoutError):
    """The lock file of a JSON store stayed held by another process (or thread) past the timeout."""

    def __init__(self, lock_path: str, timeout: float):
        super().__init__(f"{lock_path}: still held by another writer after {timeout:g} s (the timeout argument, "
                         f"default jsonstore.LOCK_TIMEOUT_S); a process that hangs while storing holds it (one "
                         f"that exited has released it)")
        self.lock_path, self.timeout = lock_path, timeout


def _timeout(timeout) -> float:
    if timeout is None:
        return LOCK_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 or None (LOCK_TIMEOUT_S), got {timeout!r}")
    return float(timeout)


@contextlib.contextmanager
def locked(path: str, timeout: float | None = None):
    """One writer of path at a time, across processes and threads (the lock file `<path>.lock` sits beside path,
    whose folder must exist). timeout: seconds to wait, default LOCK_TIMEOUT_S; past it, LockTimeout."""
    wait = _timeout(timeout)
    lock_path = path + ".lock"
    # (a new lock object per use: filelock's objects count re-entries per thread, and each use here is one
    # acquire and one release)
    lock = filelock.FileLock(lock_path, timeout=wait if wait != float("inf") else -1)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise LockTimeout(lock_path, wait) from None
    try:
        yield
    finally:
        lock.release()


def update(path: str, key: str, value, read: Callable[[str], dict], timeout: float | None = None) -> dict:
    """Set key to value in the JSON object stored at path (created with its folder if absent) and return the
    object written. read(path) gives the object now in the file ({} if none); it runs under the lock. timeout:
    as for locked()."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with locked(path, timeout):
        data = read(path)
        data[key] = value
        fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return data
