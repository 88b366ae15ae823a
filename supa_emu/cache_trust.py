"""Whether the native-build cache can be trusted: every process that emulates a card loads the
library it holds, so a cache another user can write lets that user run code in all of them.

A path is trusted when it is owned by this user or by root and no other user can change it: a
file or directory with group or world write is refused, except a directory with the sticky bit
(as /tmp), where others may add entries but cannot replace ours - what we use inside it must then
be ours (or root's) and pass the same test. The directories above the cache are checked for
write access by others only (a home under a root-owned /home is normal); the cache itself and
everything the loader reads or the builder writes in it for ownership too. Root bypasses
permission checks, so the rule reads modes and owners, never tries access.
"""

from __future__ import annotations

import os
import pathlib
import stat
from typing import Iterable, Optional

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def problem(path: pathlib.Path, check_owner: bool = True, euid: Optional[int] = None) -> Optional[str]:
    """Why `path` must not be trusted (the permission found), or None; a missing path is fine
    (whoever creates it is this process)."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # creating it will fail with its own clear error
        return None
    euid = os.geteuid() if euid is None else euid
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        # A link is as trustworthy as whoever may change it: its owner (links have no mode).
        if check_owner and info.st_uid not in (euid, 0):
            return f"a symbolic link owned by uid {info.st_uid} (this process runs as uid {euid})"
        return problem(path.resolve(), check_owner, euid)
    if check_owner and info.st_uid not in (euid, 0):
        return f"owned by uid {info.st_uid} (this process runs as uid {euid}), mode {mode:04o}"
    if mode & _OTHERS_WRITE and not (stat.S_ISDIR(info.st_mode) and mode & stat.S_ISVTX):
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if mode & bit)
        return f"writable by {who} (mode {mode:04o}, owner uid {info.st_uid})"
    return None


def untrusted(cache_dir: pathlib.Path, inside: Iterable[pathlib.Path]) -> Optional[tuple[pathlib.Path, str]]:
    """The first path that makes the cache untrustworthy and why, or None.

    `inside`: the paths under `cache_dir` the caller will read or write.
    """
    cache_dir = pathlib.Path(os.path.abspath(cache_dir))
    for ancestor in reversed(cache_dir.parents):
        found = problem(ancestor, check_owner=False)
        if found is not None:
            return ancestor, found
    for path in (cache_dir, *inside):
        found = problem(path)
        if found is not None:
            return path, found
    return None
