"""Files a checkpoint names, read only inside its directory.

A DCP checkpoint's ``.metadata`` names the file of every stored piece
(``_StorageInfo.relative_path``) and an HF checkpoint's ``model.safetensors.index.json``
the file of every tensor: a checkpoint may come from elsewhere, so each such name is
resolved here before anything is opened.  It must stay inside the checkpoint's directory
(no ``..``, no absolute path, no symlink leading out of it) and be a regular file (a FIFO,
device or directory is refused from ``os.stat``, never opened, so a read cannot hang).

One exception, for the layout of the Hugging Face hub cache: a file of
``.../models--org--name/snapshots/<revision>/`` may be a symlink into that repository's
``blobs/`` folder (``snapshot_download`` writes it so).

Example::

    from fxshard.state.files import confined_file
    path = confined_file("ckpt/step100", "__0_0.distcp", what="fxshard.load: ckpt/step100/.metadata names")
"""
from __future__ import annotations

import hashlib
import os
import stat

from fxshard.errors import PlanError

DIGEST = "sha256"  # hashlib's name of the digest a commit file records


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _roots(directory: str) -> list[str]:
    """Where files of ``directory`` may live: the directory, and for an HF hub cache
    snapshot its repository's ``blobs/``."""
    root = os.path.realpath(directory)
    roots = [root]
    parent = os.path.dirname(root)
    if os.path.basename(parent) == "snapshots":
        blobs = os.path.join(os.path.dirname(parent), "blobs")
        if os.path.isdir(blobs):
            roots.append(os.path.realpath(blobs))
    return roots


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def regular_file(path: str | os.PathLike, *, what: str) -> str:
    """``path`` if it is a regular file (after symlinks), else a PlanError naming it:
    checked with ``os.stat``, so a FIFO or device is refused without being opened.
    ``what``: who is reading it, for the message.

    Example: ``regular_file("ckpt/step100/fxshard_commit.json", what="fxshard.load")``
    """
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise PlanError(f"{what}: {path} does not exist\n  fix: is the checkpoint complete? copy it again "
                        f"from where it was written") from None
    except OSError as e:
        raise PlanError(f"{what}: {path} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise PlanError(f"{what}: {path} is {_kind(mode)}, not a regular file; it was not opened\n  fix: the "
                        f"checkpoint's files must be plain files (copy the checkpoint with its files, not links "
                        f"to other things)")
    return path


def confined_file(directory: str | os.PathLike, name, *, what: str) -> str:
    """The path of the regular file that ``name`` (a name a checkpoint file holds) names
    inside ``directory``; a PlanError naming ``name`` and the fix otherwise: an absolute
    name, a ``..`` part, a symlink resolving outside ``directory``, a missing file, or
    anything but a regular file (refused from ``os.stat``, never opened).

    Example::

        confined_file("ckpt", "__0_0.distcp", what="fxshard.load")      # 'ckpt/__0_0.distcp'
        confined_file("ckpt", "../other/__0_0.distcp", what="...")      # PlanError
    """
    directory = os.fspath(directory)
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name or "\0" in name:
        raise PlanError(f"{what} {name!r} as the name of a file in {directory}: not a file name\n  fix: the "
                        f"checkpoint was tampered with or damaged; use a copy from its source")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or ".." in parts:
        raise PlanError(f"{what} the file {name!r}, which is outside {directory}: a checkpoint's files are read "
                        f"only inside its directory (no absolute paths, no '..'); nothing was read\n  fix: the "
                        f"checkpoint was tampered with or written by another tool; use one whose files it names "
                        f"relative to its directory")
    joined = os.path.join(directory, name)
    real = os.path.realpath(joined)
    if not any(_inside(real, root) for root in _roots(directory)):
        raise PlanError(f"{what} {name!r}: {joined} is a symlink to {real}, outside {directory}: a checkpoint's "
                        f"files are read only inside its directory; nothing was read\n  fix: copy the file into "
                        f"the directory in place of the link (cp -L), if you trust where it points")
    regular_file(joined, what=f"{what} {name!r}")
    return joined


def file_digest(path: str | os.PathLike) -> str:
    """The hex digest (:data:`DIGEST`) of a file's bytes, as a commit file records it.

    Example: ``file_digest("ckpt/step100/__0_0.distcp")  # '9f86d0...'``
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, DIGEST).hexdigest()
