"""``python -m fxshard train`` and ``python -m fxshard export``: the trainer's command lines.

    torchrun --nproc-per-node 4 -m fxshard train --model path/to/checkpoint --data book.txt \\
        --mesh dp=2,tp=2 --steps 100 --log-dir runs/a --ckpt-dir ckpt --export-hf out/model
    python -m fxshard export ckpt/step000100 out/model

A flag, file or mesh the trainer cannot run is said on stderr before any work, with exit
status 2 (:class:`fxshard.trainer.errors.TrainerError`).
"""
from __future__ import annotations

import argparse
import sys

from fxshard.trainer.arguments import add_export_arguments, add_train_arguments
from fxshard.trainer.errors import TrainerError


def add_parsers(sub) -> None:
    """The ``train`` and ``export`` sub-commands of ``python -m fxshard``."""
    add_train_arguments(sub.add_parser("train", help="train a model on text files, any mesh of dp, tp, pp, cp, ep",
                                       formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    add_export_arguments(sub.add_parser("export", help="a trainer checkpoint as an HF checkpoint (save_pretrained)"))


def run_train(args) -> int:
    from fxshard.trainer.loop import run

    try:
        return run(args)
    except TrainerError as e:
        print(f"fxshard train: error: {e}", file=sys.stderr, flush=True)
        return 2


def run_export(args) -> int:
    from fxshard.trainer.export import export_checkpoint
    from fxshard.trainer.models import require

    try:
        require("transformers")
        out = export_checkpoint(args.checkpoint, args.output, args.model_dir)
    except TrainerError as e:
        print(f"fxshard export: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"exported {args.checkpoint} to {out}", flush=True)
    return 0
