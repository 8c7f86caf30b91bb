"""Output files, written the way a user expects (`write_text_file`), and the one-line error
a plan file or an output path raises (`PlanError`).

At the bottom of `meshplan.ir`: plans (`plan`) and cluster files (`cluster_io`) are both
written through it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


class PlanError(ValueError):
    """A plan that cannot be loaded or does not match the model or cluster (one-line message)."""


def write_text_file(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` the way a user expects of an output file, and atomically.

    - A regular file (new or existing) is written to a temporary file in the same folder and
      renamed over it, so readers never see half a file. The new file gets the mode the
      umask gives (`open`'s 0o666 & ~umask), or an existing file's mode is kept: never
      the 0600 of `tempfile.mkstemp`.
    - A symbolic link is written through (its target is replaced, not the link).
    - Anything that is not a regular file (`/dev/null`, `/dev/stdout`, a FIFO) is opened and
      written in place: renaming over it would replace a device node with a plain file.
    - A folder is refused with one line (`PlanError`) naming it.
    Folders on the way are created. Write errors (no space, no permission) raise `OSError`.
    """
    target = Path(os.path.realpath(path))  # through symbolic links
    if target.is_dir():
        example = Path(path) / "plan.json"
        raise PlanError(f"{path}: is a directory; give a file name, e.g. {example}")
    if target.exists() and not target.is_file():  # a device, a FIFO, a socket
        with open(target, "w") as f:
            f.write(text)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
    tmp, fd = _new_temp_file(target)
    try:
        with os.fdopen(fd, "w") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _new_temp_file(target: Path) -> tuple[str, int]:
    """A new file next to `target`, created 0o666 so the umask applies (mkstemp's is 0600)."""
    for _ in range(100):
        tmp = str(target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(f"{target.parent}: cannot create a temporary file")
