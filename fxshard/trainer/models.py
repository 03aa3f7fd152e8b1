"""What ``--model`` names, and how each kind is built.

Three kinds:

* a local HF checkpoint directory (``config.json``, ``*.safetensors``, tokenizer files),
  as ``save_pretrained`` writes it: on one process ``from_pretrained``; on a mesh the
  model is built on the meta device, transformed, and each rank reads only its own
  slices of the safetensors files (``fxshard.load_hf_checkpoint``), never a full copy;
* an HF model type (``llama``, ``qwen3``, ``mixtral``...): built small from its config
  class with random weights (``fxshard.testing.hf_tiny.tiny_config``; ``--model-config``
  overrides any field), the same seeded weights on every rank;
* ``torchtitan-llama3``: torchtitan's Llama 3 (its own plan), small, random weights.

Example::

    source = ModelSource.resolve("path/to/checkpoint")      # or "qwen3", "torchtitan-llama3"
    model = source.build(meta=True)                          # weights come later, per rank
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fxshard.trainer.errors import TrainerError

TORCHTITAN_LLAMA3 = "torchtitan-llama3"
EXTRA_OF = {"transformers": "hf", "torchtitan": "torchtitan", "datasets": "train"}


def require(module: str) -> None:
    """Import ``module`` or say which extra of fxshard installs it."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        extra = EXTRA_OF.get(module, "train")
        raise TrainerError(f"{module} is not installed ({e})\n  fix: pip install 'fxshard[{extra}]'") from None


def parse_overrides(text: str) -> dict:
    """``"hidden_size=128,num_hidden_layers=4"`` -> ``{"hidden_size": 128, "num_hidden_layers": 4}``
    (values read as Python literals, else kept as strings)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip().isidentifier():
            raise TrainerError(f"--model-config {text!r}: {part!r} is not KEY=VALUE\n  fix: e.g. "
                               f"--model-config hidden_size=128,num_hidden_layers=4")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def check_hf_config(model_dir: str | os.PathLike) -> dict:
    """``model_dir/config.json`` read as plain JSON and checked before transformers sees it:
    an object whose ``model_type`` is one this transformers ships. A directory's own code
    (``auto_map`` naming ``configuration_*.py`` / ``modeling_*.py``) is never run: with an
    unknown type and an ``auto_map`` transformers would ask at a terminal whether to run it,
    and fxshard says no before it can ask (a TrainerError naming the file).

    Example::

        check_hf_config("path/to/checkpoint")["model_type"]   # 'llama'
    """
    import json

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = os.path.join(os.fspath(model_dir), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise TrainerError(f"{path} does not read as JSON ({e})\n  fix: the config.json save_pretrained writes") from None
    if not isinstance(raw, dict):
        raise TrainerError(f"{path} is a JSON {type(raw).__name__}, not a config\n  fix: the config.json "
                           f"save_pretrained writes")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        code = (f"; its auto_map names code in {os.path.dirname(path)} ({', '.join(map(str, raw['auto_map'].values()))}), "
                f"which fxshard never runs" if isinstance(raw.get("auto_map"), dict) else "")
        raise TrainerError(f"{path}: model_type {model_type!r} is not one transformers ships{code}\n  fix: a checkpoint "
                           f"of a model type transformers has (llama, qwen3, mixtral, ...), or a transformers "
                           f"version that has this type")
    return raw


def load_hf_config(model_dir: str | os.PathLike):
    """The ``PretrainedConfig`` of a checkpoint directory, with ``trust_remote_code=False``
    (after :func:`check_hf_config`); a config transformers cannot read is a TrainerError naming it.

    Example::

        cfg = load_hf_config("path/to/checkpoint")   # LlamaConfig(...)
    """
    from transformers import AutoConfig

    check_hf_config(model_dir)
    try:
        return AutoConfig.from_pretrained(os.fspath(model_dir), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a broken config is the user's input
        raise TrainerError(f"{os.path.join(os.fspath(model_dir), 'config.json')} does not load: {type(e).__name__}: "
                           f"{e}\n  fix: the config.json save_pretrained writes") from None


def hf_model_types() -> list[str]:
    """The HF model types ``AutoModelForCausalLM`` can build."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@dataclass
class ModelSource:
    """A resolved ``--model``: ``kind`` is ``"hf_dir"``, ``"hf_type"`` or ``"torchtitan"``."""

    kind: str
    name: str
    overrides: dict = field(default_factory=dict)
    seed: int = 0
    positions: int = 0  # the sequence length trained: a model built from its type gets at least as many positions

    @classmethod
    def resolve(cls, name: str, overrides: dict | None = None, seed: int = 0) -> "ModelSource":
        overrides = dict(overrides or {})
        if name == TORCHTITAN_LLAMA3:
            require("torchtitan")
            return cls("torchtitan", name, overrides, seed)
        if os.path.isdir(name):
            if not os.path.isfile(os.path.join(name, "config.json")):
                raise TrainerError(f"--model {name}: the directory has no config.json\n  fix: a checkpoint directory "
                                   f"written by save_pretrained (config.json, *.safetensors, tokenizer files)")
            if overrides:
                raise TrainerError(f"--model-config {overrides} with a checkpoint directory: its config.json is the "
                                   f"model\n  fix: drop --model-config, or edit {os.path.join(name, 'config.json')}")
            require("transformers")
            check_hf_config(name)
            return cls("hf_dir", os.path.abspath(name), overrides, seed)
        require("transformers")
        types = hf_model_types()
        if name in types:
            return cls("hf_type", name, overrides, seed)
        looks_like_path = os.sep in name or name.startswith(".")
        raise TrainerError(
            f"--model {name}: {'no such directory' if looks_like_path else 'not a model this trainer knows'}\n  fix: "
            f"--model is one of: a local HF checkpoint directory (save_pretrained's config.json + *.safetensors); "
            f"{TORCHTITAN_LLAMA3}; or an HF model type built small with random weights: {', '.join(types)}")

    @property
    def input_name(self) -> str:
        """The model's token input: HF ``input_ids``, torchtitan ``tokens``."""
        return "tokens" if self.kind == "torchtitan" else "input_ids"

    @property
    def tokenizer_dir(self) -> str | None:
        return self.name if self.kind == "hf_dir" else None

    def hf_config(self, vocab_size: int | None = None):
        """The HF config the model is built from (``vocab_size``: a model built from its type
        takes the tokenizer's vocabulary)."""
        if self.kind == "hf_dir":
            cfg = load_hf_config(self.name)
        elif self.kind == "hf_type":
            from fxshard.testing.hf_tiny import TinyBuildError, tiny_config

            overrides = dict(self.overrides)
            if vocab_size is not None:
                overrides.setdefault("vocab_size", vocab_size)
            try:
                cfg = tiny_config(self.name, **overrides)
            except (TinyBuildError, TypeError) as e:
                raise TrainerError(f"--model {self.name} --model-config {self.overrides}: {e}") from None
            if getattr(cfg, "max_position_embeddings", None) and "max_position_embeddings" not in self.overrides:
                cfg.max_position_embeddings = max(cfg.max_position_embeddings, self.positions)
        else:
            return None
        # scaled_dot_product_attention: the attention context parallelism rewrites, and the fastest on GPUs
        cfg._attn_implementation = "sdpa"
        # MoE experts keep HF's default kernel (grouped_mm) on one process; sharded, fxshard runs its own
        # grouped GEMMs (runtime.routed_experts.grouped_experts_forward), which capture on the meta device in
        # any dtype. Never batched_mm: it gathers each token's expert weights (0.66 GiB a token a layer for
        # Mixtral-8x7B)
        return cfg

    def vocab_size(self, tokenizer_vocab: int | None = None) -> int:
        if self.kind == "torchtitan":
            return int(self.overrides.get("vocab_size", tokenizer_vocab or 128))
        return self.hf_config(tokenizer_vocab).get_text_config().vocab_size

    def build(self, *, meta: bool, vocab_size: int | None = None, device: str | torch.device = "cpu") -> nn.Module:
        """The single-device model, in float32 and train mode.  ``meta=True``: no storage (a
        checkpoint directory's weights are read per rank after the transform); a model of
        random weights is always built real, from ``seed``, so every rank and one process
        start from the same weights."""
        if self.kind == "torchtitan":
            from fxshard.testing.torchtitan_models import tiny_llama3

            kw = {"attn": "sdpa", "max_seq_len": max(64, self.positions), **self.overrides}
            if vocab_size is not None:
                kw.setdefault("vocab_size", vocab_size)
            return tiny_llama3(seed=self.seed, **kw).to(device).train()
        from transformers import AutoModelForCausalLM

        cfg = self.hf_config(vocab_size)
        if self.kind == "hf_dir" and meta:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
        if self.kind == "hf_dir":
            from fxshard.state.hf_checkpoint import checkpoint_files

            # the checks a mesh's reader makes (files inside the directory, no stale index beside
            # model.safetensors), so one process and a mesh read the same weights
            checkpoint_files(self.name)
            return AutoModelForCausalLM.from_pretrained(self.name, config=cfg, dtype=torch.float32,
                                                        trust_remote_code=False).to(device).train()
        torch.manual_seed(self.seed)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device).train()

    def build_meta(self, vocab_size: int | None = None) -> nn.Module:
        """The model on the meta device (no storage, no init): what a planner reads."""
        if self.kind == "torchtitan":
            with torch.device("meta"):
                return self.build(meta=True, vocab_size=vocab_size, device="meta")
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config(vocab_size), dtype=torch.float32)

    @property
    def loads_weights_per_rank(self) -> bool:
        """Whether a sharded run reads its weights from the checkpoint after the transform."""
        return self.kind == "hf_dir"
