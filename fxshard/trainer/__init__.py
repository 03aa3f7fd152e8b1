"""``python -m fxshard train``: the trainer (see docs/trainer.md)."""
