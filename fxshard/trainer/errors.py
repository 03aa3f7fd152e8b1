"""The trainer's own error: a flag, file or combination it cannot run, said before any work."""
from __future__ import annotations


class TrainerError(Exception):
    """A trainer input that cannot be used (a flag, a file, a mesh for this model).

    The message names what was given, what is accepted and the fix; ``python -m fxshard
    train`` prints it and exits with status 2 (under torchrun once: rank 0 before the
    processes meet, else the first rank that failed; ``fxshard.cli.train.run_train``).

    Example::

        raise TrainerError("--mesh foo=2: unknown axis 'foo'\\n  fix: use dp, tp, pp, cp or ep")
    """
