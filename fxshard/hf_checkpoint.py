"""``fxshard.load_hf_checkpoint``: read an HF safetensors checkpoint into a
transformed model, each rank reading only its own slices.

Example::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sharded = fxshard.transform(model, fxshard.Plan.from_hf(mesh, model), example_kwargs={"input_ids": ids})
    fxshard.materialize(sharded, model, device="cuda", init=None)   # allocate, rotary tables
    fxshard.load_hf_checkpoint(sharded, "path/to/checkpoint")       # model.safetensors or its index

Each tensor is read with safetensors' slice reads (``get_slice(name)[rows, cols]``), a
box per piece of the rank's shard (:mod:`fxshard.shards`): one box for an ordinary
shard, one per part for a fused projection (Phi-3's ``qkv_proj``: the rank's q, k and
v rows), none for a rank an uneven axis leaves empty.  No full tensor is ever in
memory.  Tied weights are read once (HF saves one name of a tie); values are converted
to the dtype of the model's tensor.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.fx as fx

from . import runtime
from .errors import PlanError
from .module_state import named_state
from .progress import progress
from .shards import assemble, runs_of

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(path: str | os.PathLike) -> dict[str, Path]:
    """``{tensor name: file}`` of an HF checkpoint directory (sharded with an index, or
    one ``model.safetensors``), or of one ``.safetensors`` file."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / INDEX).exists():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        return {name: path / f for name, f in weight_map.items()}
    elif (path / SINGLE).exists():
        files = [path / SINGLE]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"load_hf_checkpoint: no {INDEX}, {SINGLE} or *.safetensors in {path}")
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            out.update({name: f for name in st.keys()})
    return out


def checkpoint_names(sharded: fx.GraphModule, names, model=None) -> dict[str, str]:
    """``{checkpoint name: model FQN}``: HF 5.x renames keys between checkpoints and
    modules (GPT-NeoX's ``embed_out`` is ``lm_head``, legacy ``LayerNorm.gamma``); its own
    table (``transformers.conversion_mapping``) says how, for ``model`` or for the class
    and ``model_type`` the capture recorded.  A tensor HF must *compute* from several
    checkpoint tensors (a ``WeightConverter``: per-expert weights stacked into one) is a
    PlanError: it cannot be read by slices yet."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return {n: n for n in names}
    if model is not None:
        transforms = get_model_conversion_mapping(model)
    else:
        transforms = (get_checkpoint_conversion_mapping(sharded.meta.get("model_class", ""))
                      or get_checkpoint_conversion_mapping(sharded.meta.get("model_type", "")) or [])
    local = {fqn for fqn, _, _ in named_state(sharded)}
    out = {}
    for name in names:
        key = name
        for t in transforms:
            key, matched = t.rename_source_key(key)
            if matched is not None and isinstance(t, WeightConverter):
                raise PlanError(f"load_hf_checkpoint: {name!r} is converted by HF on load ({t}), not read as it is; "
                                f"fxshard cannot read such tensors by slices yet\n  fix: load the model with "
                                f"from_pretrained on one host and use fxshard.load_full_state_dict")
        out[name] = key if key in local or name not in local else name
    return out


def load_hf_checkpoint(sharded: fx.GraphModule, path: str | os.PathLike, *, model=None, strict: bool = True,
                       show_progress: bool | None = None) -> None:
    """Copy this rank's slices of every tensor in the checkpoint at ``path`` into
    ``sharded`` (in place; tensors on the meta device must be allocated first, see
    :func:`fxshard.materialize`).  ``strict``: every persistent tensor of the model
    must be in the checkpoint (a tied one under any of its names) and every
    checkpoint tensor in the model.  ``model``: the HF model transformed (optional),
    for its checkpoint key renames (see :func:`checkpoint_names`).  ``show_progress``: a
    progress bar (default: on rank 0 of an interactive run)."""
    from safetensors import safe_open

    if "fxshard_state" not in getattr(sharded, "meta", {}):
        raise PlanError("load_hf_checkpoint: this GraphModule was not produced by fxshard.transform")
    mesh = runtime.bound_mesh()
    files = checkpoint_files(path)
    persistent = set(sharded.state_dict().keys())
    by_tensor: dict[int, list[str]] = {}
    local = {}
    for fqn, t, _ in named_state(sharded):
        by_tensor.setdefault(id(t), []).append(fqn)
        local[fqn] = t
    meta_left = [fqn for fqn, t in local.items() if t.is_meta]
    if meta_left:
        raise PlanError(f"load_hf_checkpoint: {meta_left[:4]} are on the meta device; call "
                        f"fxshard.materialize(sharded, model, device=..., init=None) first")
    to_fqn = checkpoint_names(sharded, files, model)
    unexpected = [name for name in files if to_fqn[name] not in local]
    loaded: set[int] = set()
    if strict and unexpected:
        raise PlanError(f"load_hf_checkpoint: the checkpoint has tensors the model does not: {unexpected[:8]}\n"
                        f"  fix: is it this model's checkpoint? strict=False skips them")
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        if to_fqn[name] in local:
            by_file.setdefault(f, []).append(name)
    bar = progress(sum(len(v) for v in by_file.values()), "loading checkpoint", show_progress)
    try:
        with torch.no_grad():
            for f, names in by_file.items():
                with safe_open(f, framework="pt") as st:
                    for name in names:
                        fqn = to_fqn[name]
                        t = local[fqn]
                        piece = st.get_slice(name)
                        shape = tuple(piece.get_shape())
                        _, want = sharded.meta["fxshard_state"].get(fqn, (None, tuple(t.shape)))
                        if tuple(want) != shape:
                            raise PlanError(f"load_hf_checkpoint: {name} has shape {shape} in {f.name}, the model's is "
                                            f"{tuple(want)}; is it the checkpoint of this config?")
                        target = t.to_local() if hasattr(t, "to_local") else t
                        assemble(runs_of(sharded, fqn, mesh, t), lambda box: piece[box.glob].to(target.dtype), target.data)
                        loaded.add(id(t))
                        bar.update(1)
    finally:
        bar.close()
    missing = [fqns[0] for tid, fqns in by_tensor.items()
               if tid not in loaded and any(f in persistent for f in fqns)]
    if strict and missing:
        raise PlanError(f"load_hf_checkpoint: the checkpoint lacks {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                        f"\n  fix: is it this model's checkpoint? strict=False keeps their current values")
