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
to the dtype of the model's tensor.  HF's renames and its per-expert stacking (MoE
checkpoints: ``experts.{e}.w1`` into ``experts.gate_up_proj``) come from HF's own
conversion table; a stacked tensor is read box by box too, expert by expert.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx

from fxshard.runtime import collectives
from fxshard.errors import PlanError
from fxshard.meta import program_meta
from fxshard.state.module_state import named_state
from fxshard.state.progress import progress
from fxshard.state.shards import assemble, runs_of

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


@dataclass
class Leaf:
    """One checkpoint tensor."""

    name: str
    file: Path
    shape: tuple[int, ...]


@dataclass
class Stacked:
    """``torch.stack(parts, dim)`` (HF's ``MergeModulelist``: per-expert weights)."""

    dim: int
    parts: list
    shape: tuple[int, ...] = ()

    def __post_init__(self):
        first = self.parts[0].shape
        self.shape = first[:self.dim] + (len(self.parts),) + first[self.dim:]


@dataclass
class Concatenated:
    """``torch.cat(parts, dim)`` (HF's ``Concatenate``: gate and up into gate_up)."""

    dim: int
    parts: list
    shape: tuple[int, ...] = ()

    def __post_init__(self):
        first = self.parts[0].shape
        self.shape = first[:self.dim] + (sum(p.shape[self.dim] for p in self.parts),) + first[self.dim + 1:]


Source = Leaf | Stacked | Concatenated


def read_box(source: Source, box: tuple[slice, ...], open_file) -> torch.Tensor:
    """The ``box`` of the tensor ``source`` describes, reading from the checkpoint only
    the elements inside it (``open_file(path)``: an open safetensors handle)."""
    if isinstance(source, Leaf):
        return open_file(source.file).get_slice(source.name)[box]
    d, sel = source.dim, box[source.dim]
    if isinstance(source, Stacked):
        rest = box[:d] + box[d + 1:]
        return torch.stack([read_box(source.parts[i], rest, open_file) for i in range(sel.start, sel.stop)], d)
    pieces, pos = [], 0
    for part in source.parts:
        n = part.shape[d]
        lo, hi = max(sel.start, pos), min(sel.stop, pos + n)
        if lo < hi:
            pieces.append(read_box(part, box[:d] + (slice(lo - pos, hi - pos),) + box[d + 1:], open_file))
        pos += n
    return torch.cat(pieces, d)


def checkpoint_sources(sharded: fx.GraphModule, files: dict[str, Path], shapes: dict[str, tuple], model=None
                       ) -> dict[str, Source]:
    """``{model FQN: source}``: which checkpoint tensors make each of the model's.

    HF 5.x renames keys between checkpoints and modules (GPT-NeoX's ``embed_out`` is
    ``lm_head``, legacy ``LayerNorm.gamma``) and *computes* some tensors from several
    (a ``WeightConverter``: Mixtral's per-expert ``w1``/``w3`` stacked and concatenated
    into ``experts.gate_up_proj``); its own table (``transformers.conversion_mapping``)
    says how, for ``model`` or for the class and ``model_type`` the capture recorded.
    The stack and concatenation operations are read box by box like any tensor; any
    other conversion (a transpose, a rope permutation) is a PlanError."""
    local = {fqn for fqn, _, _ in named_state(sharded)}
    direct = {name: name for name in files}
    transforms = _hf_transforms(sharded, model)
    groups: dict[str, dict[str, list[tuple[int, str]]]] = {}  # converted target -> source pattern -> (index, name)
    converters = {}
    for name in files:
        key = name
        for t in transforms:
            key, matched = t.rename_source_key(key)
            if matched is not None and hasattr(t, "operations"):
                index = _index_in(matched, name)
                groups.setdefault(key, {}).setdefault(matched, []).append((index, name))
                converters[key] = t
                break
        else:
            direct[name] = key if key in local or name not in local else name
            continue
        del direct[name]
    sources: dict[str, Source] = {fqn: Leaf(name, files[name], shapes[name]) for name, fqn in direct.items()}
    for target, by_pattern in groups.items():
        sources[target] = _converted(converters[target], by_pattern, files, shapes)
    return sources


def _hf_transforms(sharded, model) -> list:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
    except ImportError:
        return []
    if model is not None:
        return get_model_conversion_mapping(model)
    return (get_checkpoint_conversion_mapping(program_meta(sharded).model_class or "")
            or get_checkpoint_conversion_mapping(program_meta(sharded).model_type or "") or [])


def _index_in(pattern: str, name: str) -> int:
    """The module-list index the ``*`` of an HF source pattern stands for in ``name``."""
    import re

    rx = re.escape(pattern).replace(r"\*", r"(\d+)")
    m = re.search(rx, name)
    return int(m.group(1)) if m and m.groups() else 0


def _converted(converter, by_pattern: dict, files, shapes) -> Source:
    from transformers.core_model_loading import Concatenate, MergeModulelist

    state: dict[str, object] = {p: [Leaf(n, files[n], shapes[n]) for _, n in sorted(parts)] for p, parts in by_pattern.items()}
    for op in converter.operations:
        if isinstance(op, MergeModulelist):
            state = {p: Stacked(op.dim, v) if isinstance(v, list) else v for p, v in state.items()}
        elif isinstance(op, Concatenate):
            parts = []
            for p in converter.source_patterns:  # HF keeps the order of the source patterns
                if p in state:
                    v = state[p]
                    parts.extend(v if isinstance(v, list) else [v])
            state = {"": Concatenated(op.dim, parts)}
        else:
            raise PlanError(f"load_hf_checkpoint: HF converts {sorted(by_pattern)} with {op} on load, which fxshard "
                            f"cannot read by slices yet\n  fix: load the model with from_pretrained on one host and "
                            f"use fxshard.load_full_state_dict")
    (source,) = state.values()
    if isinstance(source, list):
        (source,) = source
    return source


def load_hf_checkpoint(sharded: fx.GraphModule, path: str | os.PathLike, *, model=None, strict: bool = True,
                       show_progress: bool | None = None) -> None:
    """Copy this rank's slices of every tensor in the checkpoint at ``path`` into
    ``sharded`` (in place; tensors on the meta device must be allocated first, see
    :func:`fxshard.materialize`).  ``strict``: every persistent tensor of the model
    must be in the checkpoint (a tied one under any of its names) and every
    checkpoint tensor in the model.  ``model``: the HF model transformed (optional),
    for its checkpoint key renames and conversions (see :func:`checkpoint_sources`).
    ``show_progress``: a progress bar (default: on rank 0 of an interactive run)."""
    import contextlib

    from safetensors import safe_open

    if program_meta(sharded).state is None:
        raise PlanError("load_hf_checkpoint: this GraphModule was not produced by fxshard.transform")
    mesh = collectives.bound_mesh()
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
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def open_file(f: Path):
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(f, framework="pt"))
            return handles[f]

        shapes = {name: tuple(open_file(f).get_slice(name).get_shape()) for name, f in files.items()}
        sources = checkpoint_sources(sharded, files, shapes, model)
        unexpected = [fqn for fqn in sources if fqn not in local]
        if strict and unexpected:
            raise PlanError(f"load_hf_checkpoint: the checkpoint has tensors the model does not: {unexpected[:8]}\n"
                            f"  fix: is it this model's checkpoint? strict=False skips them")
        todo = sorted((fqn for fqn in sources if fqn in local), key=lambda fqn: str(_first_file(sources[fqn])))
        loaded: set[int] = set()
        bar = progress(len(todo), "loading checkpoint", show_progress)
        try:
            with torch.no_grad():
                for fqn in todo:
                    source, t = sources[fqn], local[fqn]
                    _, want = program_meta(sharded).state.get(fqn, (None, tuple(t.shape)))
                    if tuple(want) != tuple(source.shape):
                        raise PlanError(f"load_hf_checkpoint: {fqn} has shape {tuple(source.shape)} in the checkpoint, "
                                        f"the model's is {tuple(want)}; is it the checkpoint of this config?")
                    target = t.to_local() if hasattr(t, "to_local") else t
                    assemble(runs_of(sharded, fqn, mesh, t),
                             lambda box: read_box(source, box.glob, open_file).to(target.dtype), target.data)
                    loaded.add(id(t))
                    bar.update(1)
        finally:
            bar.close()
    missing = [fqns[0] for tid, fqns in by_tensor.items()
               if tid not in loaded and any(f in persistent for f in fqns)]
    if strict and missing:
        raise PlanError(f"load_hf_checkpoint: the checkpoint lacks {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                        f"\n  fix: is it this model's checkpoint? strict=False keeps their current values")


def _first_file(source: Source) -> Path:
    return source.file if isinstance(source, Leaf) else _first_file(source.parts[0])
