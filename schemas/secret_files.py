"""Reading secrets and trusted keys from files, refusing files others may change.

Whoever can write a trusted key, a private key or a password file can act as an operator or as
the service it belongs to, so such a file (and a trusted-keys directory) must be writable by its
owner only: anything else is a `ConfigurationError` naming the file. A secret that others may
read is logged as a warning, not refused: mounted secrets (Kubernetes' default mode is 0644) are
often readable by the container's other users, who are the same service.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

from schemas.errors import ConfigurationError

log = logging.getLogger(__name__)

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OTHERS_READ = stat.S_IRGRP | stat.S_IROTH


def check_owner_writes(path: Path, what: str) -> int:
    """Refuse `path` (a file or a directory) if its group or others may write it; its mode."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise ConfigurationError(f"cannot read the {what} {path}: {e.strerror}") from e
    if mode & _OTHERS_WRITE:
        raise ConfigurationError(
            f"the {what} {path} is writable by others (mode {stat.S_IMODE(mode):o}): whoever can "
            "change it could act with its authority; make it writable by its owner only "
            "(chmod go-w)"
        )
    return mode


def read_secret(path: Path, what: str) -> bytes:
    """The bytes of a secret's file: refused if others may write it, warned if they may read it."""
    if check_owner_writes(path, what) & _OTHERS_READ:
        log.warning(
            "the %s %s is readable by others (chmod go-r if they are not trusted)", what, path
        )
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigurationError(f"cannot read the {what} {path}: {e.strerror}") from e
