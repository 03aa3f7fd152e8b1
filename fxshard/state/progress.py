"""Progress bars for long loads and saves (tqdm), shown on one rank only.

Example::

    bar = progress(len(names), "loading checkpoint")
    for name in names:
        ...
        bar.update(1)
    bar.close()
"""
from __future__ import annotations

import sys


def progress(total: int | None, desc: str, show: bool | None = None, unit: str = "tensor"):
    """A tqdm bar of ``total`` steps (``None``: set later with ``bar.reset(total=n)``).
    ``show=None``: on rank 0 only, and only when stderr is a terminal (a CI log or a
    spawned worker stays quiet)."""
    from tqdm.auto import tqdm

    if show is None:
        show = _rank() == 0 and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, disable=not show, dynamic_ncols=True, leave=False)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
