"""The private temp folder of an API server's ``ipc://`` engine-core sockets: named after its
owner (the API server's pid), removed by the engine core when it finds its owner dead, and at
every start-up swept of folders whose owner is dead (a ``kill -9`` runs no clean-up of its own).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

__all__ = ["PREFIX", "create", "owner_pid", "remove_owned_by", "remove_stale"]

logger = logging.getLogger("pdserve.engine")

#: Name prefix of the folders, followed by the owner's pid, ``-`` and mkdtemp's random part.
PREFIX = "pdserve-engine-"
# mkdtemp's random part has no "-", so the pid is the digits up to the first one.
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[^-]+$")


def owner_pid(name: str) -> int | None:
    """The owner's pid in a folder name made by :func:`create` (None for another name)."""
    match = _NAME.match(os.path.basename(name))
    return int(match.group(1)) if match else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def create(root: str | None = None) -> str:
    """Sweeps folders of dead owners (:func:`remove_stale`), then makes this process's folder.

    Args:
        root: where (default: the system's temp directory).

    Returns:
        the new folder's path.
    """
    remove_stale(root)
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)


def _ours(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.getuid() and os.path.isdir(path) \
            and not os.path.islink(path)
    except OSError:
        return False


def remove_owned_by(pid: int, root: str | None = None) -> None:
    """Removes the folders of owner ``pid`` (an engine core whose API server died)."""
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        if owner_pid(name) == pid and _ours(path):
            shutil.rmtree(path, ignore_errors=True)


def remove_stale(root: str | None = None) -> list[str]:
    """Removes this user's folders whose owner no longer runs; returns their paths."""
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = owner_pid(name)
        path = os.path.join(root, name)
        if pid is not None and not _alive(pid) and _ours(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("removed %d engine socket folder(s) of processes no longer running",
                    len(removed))
    return removed
