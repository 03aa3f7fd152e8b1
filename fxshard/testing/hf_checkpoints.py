"""A checkpoint directory as a user has one: a tiny HF causal LM and its own trained tokenizer.

:func:`make_hf_checkpoint` trains a byte-level BPE tokenizer on local text with
``tokenizers`` (seconds for a few hundred KB), builds a tiny model of that vocabulary
with :func:`fxshard.testing.hf_tiny.tiny_config`, and saves both with ``save_pretrained``,
so that ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` load the directory::

    from fxshard.testing.hf_checkpoints import make_hf_checkpoint

    path = make_hf_checkpoint("/tmp/ckpt", "qwen3", text_files=["examples/data/genesis.txt"])
    # /tmp/ckpt: config.json, model.safetensors, tokenizer.json, tokenizer_config.json, ...
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["EOS_TOKEN", "train_byte_level_bpe", "make_hf_checkpoint"]

EOS_TOKEN = "<|endoftext|>"


def train_byte_level_bpe(text_files: Sequence[str | os.PathLike], vocab_size: int = 512):
    """A GPT-2-style tokenizer trained on ``text_files``: ByteLevel pre-tokenizer, BPE merges
    up to ``vocab_size`` ids (fewer when the text has no more pairs), ``<|endoftext|>`` as
    id 0 and EOS; wrapped as a ``PreTrainedTokenizerFast``.

    Example::

        tok = train_byte_level_bpe(["examples/data/genesis.txt"], vocab_size=512)
        len(tok), tok.eos_token_id      # (512, 0)
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():  # whole files: merges across line breaks ("\n\n") are learned too
        for file in text_files:
            yield Path(file).read_text(encoding="utf-8")

    tok.train_from_iterator(texts(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)


def make_hf_checkpoint(path: str | os.PathLike, model_type: str = "llama", *, text_files: Sequence[str | os.PathLike],
                       vocab_size: int = 512, seed: int = 0, **config_overrides) -> Path:
    """Write a tiny ``model_type`` causal LM and a tokenizer trained on ``text_files`` to ``path``.

    The model's vocabulary is ``vocab_size`` (the tokenizer's ids fit in it); its bos, eos and
    pad ids are the tokenizer's EOS; its weights are drawn under ``torch.manual_seed(seed)``;
    ``config_overrides`` go to :func:`~fxshard.testing.hf_tiny.tiny_config` (for example
    ``max_position_embeddings=256`` for longer sequences than the tiny 64).

    Example::

        make_hf_checkpoint(tmp_path / "ckpt", "qwen3_moe", text_files=["examples/data/genesis.txt"])
        AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    """
    from transformers import AutoModelForCausalLM

    from fxshard.testing.hf_tiny import tiny_config

    path = Path(path)
    tokenizer = train_byte_level_bpe(text_files, vocab_size)
    config = tiny_config(model_type, vocab_size=vocab_size, **config_overrides)
    eos = tokenizer.eos_token_id
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, eos)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # the generation config is derived from the config at construction: keep it in step
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(model, "generation_config", None) is not None:
            setattr(model.generation_config, name, eos)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
