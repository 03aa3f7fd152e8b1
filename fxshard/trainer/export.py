"""The weights back out: a trainer checkpoint as a consolidated HF checkpoint.

The trainer writes the model's config and tokenizer once, in ``CKPT_DIR/hf_model``; a
checkpoint (any mesh) is loaded into the plain single-device model (``load``
reshards it, no process group) and written with ``save_pretrained``: ``config.json``,
``model.safetensors`` and the tokenizer, which
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads.

Nothing the user did not name is deleted or overwritten:

* the output directory may hold other files: the export is written into a fresh directory
  of its own inside it and moved into place file by file, so only the files an export
  writes (:func:`is_export_file`: ``config.json``, ``generation_config.json``, the
  safetensors weights and their index, the tokenizer's files) are replaced; a weights file
  of an earlier export that this one does not write (``model.safetensors`` beside a new
  sharded index, or the reverse) is removed, so the directory holds one set of weights;
  any other file stays as it is;
* the output may not be, or be inside, a directory the export reads (the checkpoint, the
  config directory, the trainer's ``--model``): :func:`check_output_dir`;
* the trainer's scratch checkpoint (``--export-hf`` without ``--ckpt-dir``) is a new
  directory :func:`make_scratch_dir` creates with a marker file; :func:`remove_scratch_dir`
  deletes only a directory holding that marker.

Example::

    python -m fxshard export ckpt/step000100 out/my-model
    export_checkpoint("ckpt/step000100", "out/my-model")
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings

import torch

from fxshard.state.checkpoint import load
from fxshard.trainer.errors import TrainerError

MODEL_DIR = "hf_model"  # beside the checkpoints: the config and tokenizer an export needs
RUN_FILE = "fxshard_train.json"
SCRATCH_MARKER = "FXSHARD_SCRATCH"  # in a directory fxshard made for itself, and deletes
# the weights files of save_pretrained: one of them with an index is ambiguous, so an export removes stale ones
WEIGHTS_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
# files an export writes besides the weights (save_pretrained of the model and of its tokenizer)
EXPORT_FILES = frozenset({"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                          "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                          "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "vocab.txt"})


def is_export_file(name: str) -> bool:
    """Whether ``name`` is a file an export writes (and so may replace in its output directory).

    Example::

        is_export_file("model-00001-of-00002.safetensors")   # True
        is_export_file("README.md")                          # False: an export never touches it
    """
    return name in EXPORT_FILES or WEIGHTS_FILE.fullmatch(name) is not None


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def check_output_dir(out: str, sources: dict[str, str | None]) -> None:
    """Refuse an export directory ``out`` that is, or is inside, one of ``sources`` (what each
    is, e.g. ``{"--model": "ckpt/llama"}``): the export would overwrite what it reads. A
    TrainerError naming both; symlinks are followed.

    Example::

        check_output_dir("out/model", {"the checkpoint": "ckpt/step000100"})
    """
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainerError(f"export to {out}: it is a file, not a directory\n  fix: name a directory (new, or one "
                           f"whose other files the export leaves alone)")
    for what, source in sources.items():
        if source is not None and os.path.isdir(source) and _inside(out, source):
            same = os.path.realpath(out) == os.path.realpath(source)
            raise TrainerError(f"export to {out}: it is {'' if same else 'inside '}{what} {source}, which the export "
                               f"reads: its files would be overwritten\n  fix: export to another directory")


def make_scratch_dir(near: str) -> str:
    """A new directory beside ``near`` (``OUT.fxshard-ckpt-XXXXXXXX``, on the filesystem the
    user named, so every rank of a multi-host run sees it), marked as fxshard's own.

    Example::

        scratch = make_scratch_dir("out/model")    # out/model.fxshard-ckpt-k2j3h4a1
        ...
        remove_scratch_dir(scratch)
    """
    near = os.path.abspath(near)
    parent = os.path.dirname(near)
    os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=os.path.basename(near) + ".fxshard-ckpt-", dir=parent)
    with open(os.path.join(path, SCRATCH_MARKER), "w") as f:
        f.write("a scratch directory of fxshard train; fxshard deletes it when the export is written\n")
    return path


def remove_scratch_dir(path: str) -> bool:
    """Delete ``path`` only if it is a directory :func:`make_scratch_dir` made (its marker is
    there and it is no symlink); returns whether it was deleted."""
    if os.path.islink(path) or not os.path.isfile(os.path.join(path, SCRATCH_MARKER)):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


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


def default_model_dir(ckpt: str) -> str:
    """Where the trainer keeps the config and tokenizer of checkpoint ``ckpt``."""
    return os.path.join(os.path.dirname(os.path.abspath(ckpt)), MODEL_DIR)


def load_exportable(ckpt: str, model_dir: str | None = None):
    """The plain HF model (float32, CPU) with the weights of checkpoint ``ckpt``, and its
    tokenizer (``None`` if the run had none): one process, no process group, no code from
    the directory (``trust_remote_code=False``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fxshard.trainer.models import load_hf_config

    model_dir = model_dir or default_model_dir(ckpt)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise TrainerError(f"export {ckpt}: no config.json in {model_dir}\n  fix: export a checkpoint the trainer wrote "
                           f"with an HF model (it keeps CKPT_DIR/{MODEL_DIR}), or pass --model-dir with the config")
    config = load_hf_config(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with warnings.catch_warnings():  # DCP says it loads in one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(model, ckpt, show_progress=False)
    tokenizer = None
    if any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - a broken tokenizer is the user's input
            raise TrainerError(f"export {ckpt}: the tokenizer in {model_dir} does not load: {type(e).__name__}: "
                               f"{e}\n  fix: repair or remove its tokenizer files") from None
    return model, tokenizer


def export_checkpoint(ckpt: str, out: str, model_dir: str | None = None, *,
                      sources: dict[str, str | None] | None = None) -> str:
    """Write checkpoint ``ckpt`` as an HF checkpoint directory ``out``; returns ``out``.

    ``out`` may exist and hold other files: only the files an export writes are replaced
    (see the module's docstring). ``sources``: more directories ``out`` must stay out of
    (the trainer's ``--model``), beside the checkpoint and the config directory.
    """
    from transformers.utils import logging as hf_logging

    check_output_dir(out, {"the checkpoint": ckpt, "the config directory": model_dir or default_model_dir(ckpt),
                           **(sources or {})})
    model, tokenizer = load_exportable(ckpt, model_dir)
    hf_logging.disable_progress_bar()  # one line says what was written
    os.makedirs(out, exist_ok=True)
    # written whole into a new directory of its own first: save_pretrained cleans its target folder of
    # weight shards, and the user's folder is not its to clean
    staging = tempfile.mkdtemp(prefix=".fxshard-export-", dir=out)
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        written = sorted(os.listdir(staging))
        for name in written:
            target = os.path.join(out, name)
            if os.path.islink(target) or os.path.isdir(target) or (os.path.exists(target) and not is_export_file(name)):
                kind = "a symlink" if os.path.islink(target) else "a directory" if os.path.isdir(target) else "a file"
                raise TrainerError(f"export to {out}: {target} is {kind} the export did not write, where it would "
                                   f"write its {name}\n  fix: move it away, or export to another directory")
        for name in written:
            os.replace(os.path.join(staging, name), os.path.join(out, name))
        for name in os.listdir(out):  # an earlier export's weights that this one did not replace
            target = os.path.join(out, name)
            if WEIGHTS_FILE.fullmatch(name) and name not in written and os.path.isfile(target) \
                    and not os.path.islink(target):
                os.remove(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def max_logit_difference(out: str, ids: torch.Tensor, logits: torch.Tensor) -> float:
    """How far the exported model's logits on ``ids`` are from ``logits`` (the trained
    program's): the export's own check."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=False).eval()
    with torch.no_grad():
        got = model(input_ids=ids.cpu()).logits
    return float((got - logits.cpu().float()).abs().max())
