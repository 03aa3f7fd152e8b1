"""The model being planned: built on the meta device, its stack of blocks, its sizes.

``plan_parallelism`` takes an ``nn.Module`` or what ``python -m fxshard train --model`` takes
(a checkpoint directory, or a ``config.json`` alone, or an HF model type).  Only the model's
*structure* matters here, so a model named by path or type is built on the meta device
(nothing allocated: Llama-3-70B from its ``config.json`` in well under a second).

A deep model is captured once per plan structure, and only its first blocks: the blocks of
its stack are grouped into *kinds* as ``fxshard.frontend.repeated_blocks`` groups them for
stamping (class, parameter shapes, plain attributes), the capture holds the shortest prefix
that has a block of every kind, and block ``i`` takes the numbers of the first captured block
of its kind (:meth:`PlannedModel.source_block`).

Example::

    planned = PlannedModel.resolve("path/to/Llama-3-8B")      # a directory with config.json
    planned.n_blocks, planned.prefix                           # 32, 1
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from fxshard.errors import PlanError
from fxshard.frontend.repeated_blocks import StampPlan, plan_stamping


@dataclass
class PlannedModel:
    """A model to plan, with what the candidates' divisibility depends on."""

    model: nn.Module
    source: object  # fxshard.trainer.models.ModelSource: what build_plan needs (the kind, the input's name)
    name: str
    stamp: StampPlan | None  # the block stack, its kinds and the captured prefix; None: captured whole
    heads: int | None = None
    kv_heads: int | None = None
    experts: int | None = None
    layers: int | None = None

    @classmethod
    def resolve(cls, model) -> "PlannedModel":
        """``model``: an ``nn.Module`` (HF or torchtitan), or a string: a checkpoint directory or
        the path of a ``config.json`` (built on the meta device), or an HF model type (``llama``:
        its small test configuration, as ``python -m fxshard train --model llama`` builds)."""
        from fxshard.trainer.errors import TrainerError
        from fxshard.trainer.models import ModelSource

        if isinstance(model, nn.Module):
            kind = "torchtitan" if type(model).__module__.startswith("torchtitan") else "hf_type"
            source = ModelSource(kind, getattr(getattr(model, "config", None), "model_type", type(model).__name__))
            return cls._of(model, source, type(model).__name__)
        if not isinstance(model, (str, os.PathLike)):
            raise PlanError(f"plan_parallelism: model is a {type(model).__name__}\n  fix: an nn.Module, a checkpoint "
                            f"directory, the path of a config.json, or an HF model type ('llama')")
        path = os.fspath(model)
        if os.path.isfile(path) and path.endswith(".json"):
            path = os.path.dirname(os.path.abspath(path))
        try:
            source = ModelSource.resolve(path)
        except TrainerError as e:
            raise PlanError(str(e)) from None
        cfg = source.hf_config()
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
        return cls._of(built, source, os.path.basename(path.rstrip(os.sep)) or path)

    @classmethod
    def _of(cls, model: nn.Module, source, name: str) -> "PlannedModel":
        stamp, _ = plan_stamping(model)
        if stamp is not None:
            seen: set[int] = set()
            for k, kind in enumerate(stamp.kinds):
                seen.add(kind)
                if seen == set(stamp.kinds):
                    stamp = dataclasses.replace(stamp, captured=k + 1)
                    break
        cfg = getattr(model, "config", None)
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        experts = _first_int(text, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"))
        return cls(model, source, name, stamp, heads=_first_int(text, ("num_attention_heads", "n_head", "n_heads")),
                   kv_heads=_first_int(text, ("num_key_value_heads", "n_kv_heads", "num_attention_heads", "n_head")),
                   experts=experts, layers=_first_int(text, ("num_hidden_layers", "n_layer", "n_layers")))

    @property
    def prefix(self) -> int | None:
        """How many blocks the capture holds (``None``: the whole model)."""
        return self.stamp.captured if self.stamp is not None else None

    @property
    def input_name(self) -> str:
        return self.source.input_name

    def source_block(self, i: int, captured: list[str]) -> int:
        """The captured block whose numbers block ``i`` of the whole stack has."""
        if self.stamp is None:
            return i
        kind = self.stamp.kinds[i]
        return next(j for j in range(len(captured)) if self.stamp.kinds[j] == kind)

    def block_names(self) -> list[str]:
        """The FQNs of the model's blocks: the stack's, or the items of its module lists
        (``model.layers.0``: as ``fxshard.meta.block_of`` finds them)."""
        if self.stamp is not None:
            return [self.stamp.prefix(i) for i in range(len(self.stamp.names))]
        found = []
        for name, m in self.model.named_modules():
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and not any(name.startswith(f + ".") for f in found):
                found += [f"{name}.{k}" if name else k for k, child in m.named_children()
                          if any(True for _ in child.parameters())]
        return found

    def n_blocks(self, captured: list[str]) -> int:
        return len(self.stamp.names) if self.stamp is not None else len(captured)

    def block_name(self, i: int, captured: list[str]) -> str:
        return self.stamp.prefix(i) if self.stamp is not None else captured[i]


def _first_int(cfg, names) -> int | None:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None
