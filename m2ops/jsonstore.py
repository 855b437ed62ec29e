"""A JSON object in a file that several processes add entries to: the tuning cache (kernels/autotune.py) and the
benchmark's kept TileGym searches (bench/peer_tuning.py).

Writers take an exclusive lock on `<file>.lock` (fcntl, where the platform has it), reread the file, set their
entry and replace the file with a complete new one by rename. So readers never see half a file, and two
processes storing at once both keep their entries: without the lock, each would write back what it read plus
its own entry, and the later rename would drop the other's (several GPUs tuning side by side, or the bench's
workers with --gpus).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Callable

try:
    import fcntl
except ImportError:  # (Windows: no lock; a concurrent store may then drop another's entry)
    fcntl = None


@contextlib.contextmanager
def locked(path: str):
    """One writer of path at a time, across processes."""
    if fcntl is None:
        yield
        return
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def update(path: str, key: str, value, read: Callable[[str], dict]) -> dict:
    """Set key to value in the JSON object stored at path (created with its folder if absent) and return the
    object written. read(path) gives the object now in the file ({} if none); it runs under the lock."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with locked(path):
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
