"""The weights back out: a trainer checkpoint as a consolidated HF checkpoint.

The trainer writes the model's config and tokenizer once, in ``CKPT_DIR/hf_model``; a
checkpoint (any mesh) is loaded into the plain single-device model (``load``
reshards it, no process group) and written with ``save_pretrained``: ``config.json``,
``model.safetensors`` and the tokenizer, which
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads.

Example::

    python -m fxshard export ckpt/step000100 out/my-model
    export_checkpoint("ckpt/step000100", "out/my-model")
"""
from __future__ import annotations

import json
import os
import warnings

import torch

from fxshard.state.checkpoint import load
from fxshard.trainer.errors import TrainerError

MODEL_DIR = "hf_model"  # beside the checkpoints: the config and tokenizer an export needs
RUN_FILE = "fxshard_train.json"


def save_model_dir(ckpt_dir: str, config, tokenizer, run: dict) -> str:
    """``CKPT_DIR/hf_model``: the HF config the run trains, its tokenizer and the run's flags
    (written by rank 0, once; a resumed run rewrites the same)."""
    path = os.path.join(ckpt_dir, MODEL_DIR)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    with open(os.path.join(path, RUN_FILE), "w") as f:
        json.dump(run, f, indent=1, default=str)
    return path


def load_exportable(ckpt: str, model_dir: str | None = None):
    """The plain HF model (float32, CPU) with the weights of checkpoint ``ckpt``, and its
    tokenizer (``None`` if the run had none): one process, no process group."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = model_dir or os.path.join(os.path.dirname(os.path.abspath(ckpt)), MODEL_DIR)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise TrainerError(f"export {ckpt}: no config.json in {model_dir}\n  fix: export a checkpoint the trainer wrote "
                           f"with an HF model (it keeps CKPT_DIR/{MODEL_DIR}), or pass --model-dir with the config")
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with warnings.catch_warnings():  # DCP says it loads in one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(model, ckpt, show_progress=False)
    tokenizer = None
    if any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer


def export_checkpoint(ckpt: str, out: str, model_dir: str | None = None) -> str:
    """Write checkpoint ``ckpt`` as an HF checkpoint directory ``out``; returns ``out``."""
    from transformers.utils import logging as hf_logging

    model, tokenizer = load_exportable(ckpt, model_dir)
    hf_logging.disable_progress_bar()  # one line says what was written
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def max_logit_difference(out: str, ids: torch.Tensor, logits: torch.Tensor) -> float:
    """How far the exported model's logits on ``ids`` are from ``logits`` (the trained
    program's): the export's own check."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=ids.cpu()).logits
    return float((got - logits.cpu().float()).abs().max())
