"""Optional packages of the command line, named by the extra of fxshard that installs them.

fxshard's base install is torch and a few small packages; front ends for foreign models
need more (``pip install 'fxshard[hf]'`` for transformers).  A command that needs one
says which extra to install, in one line with exit status 2 (a usage error), instead of a
``ModuleNotFoundError`` traceback.

Example::

    from fxshard.cli.extras import require

    transformers = require("transformers", "hf")   # MissingExtra when it is not installed

``python -m fxshard`` prints a :class:`MissingExtra` as ``fxshard <command>: <message>``
and exits 2; a ``ModuleNotFoundError`` of a package in :data:`EXTRA_OF` that escapes a
command is printed the same way.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# the top-level module of each package an extra of pyproject.toml installs -> that extra
# (tests/test_cli.py checks it against the installed metadata)
EXTRA_OF = {"transformers": "hf", "accelerate": "hf", "torchtitan": "torchtitan", "datasets": "train",
            "tensorboard": "train"}


class MissingExtra(Exception):
    """An optional package a command needs is not installed.  ``str()`` is one line that
    names the extra to install; ``module`` and ``extra`` are the names."""

    exit_status = 2  # a usage error, as argparse's

    def __init__(self, module: str, extra: str, needed_by: str | None = None, missing: str | None = None):
        self.module, self.extra = module, extra
        by = f"{needed_by} needs" if needed_by else "this needs"
        why = f" ({missing} is missing)" if missing and missing != module else ""
        super().__init__(f"{by} {module}, which is not installed{why}: pip install 'fxshard[{extra}]'")


def require(module_name: str, extra: str, needed_by: str | None = None) -> ModuleType:
    """Import ``module_name`` and return it; :class:`MissingExtra` naming ``extra`` when it,
    or a package it imports, is not installed.  ``needed_by``: what needs it, for the
    message (``"--model DIR (a transformers checkpoint)"``)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise MissingExtra(module_name, extra, needed_by, e.name) from None


def missing_extra(error: BaseException, needed_by: str | None = None) -> MissingExtra | None:
    """The :class:`MissingExtra` that ``error`` means, if it is a ``ModuleNotFoundError`` of
    a package an extra installs (:data:`EXTRA_OF`); else ``None``."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    top = error.name.split(".")[0]
    if top in EXTRA_OF:
        return MissingExtra(top, EXTRA_OF[top], needed_by)
    return None
