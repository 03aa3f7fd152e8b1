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

A checkpoint may come from elsewhere, so nothing is read that it does not check out:

- every file the index's ``weight_map`` names is a regular file inside the directory
  (:func:`fxshard.state.files.confined_file`: no ``..``, no absolute path, no symlink out of
  it but the HF hub cache's own into its ``blobs/``);
- a directory is read one way whatever the mesh: ``model.safetensors`` beside
  ``model.safetensors.index.json`` is a PlanError (``from_pretrained`` would read the one
  file, this reader the index);
- a file safetensors cannot read (truncated, a damaged header) is a PlanError naming it;
- dtypes (:func:`check_dtype`): a floating tensor of the model is read from F64, F32, F16
  or BF16 and converted to the model's dtype; where ``config.json`` names the checkpoint's
  dtype, each stored floating tensor is that dtype or F32 (what HF keeps some modules in).
  Anything else stored for a floating tensor (an integer or bool relabelling, int8, FP8) is
  refused, and a non-floating tensor (an integer buffer) must be stored in its own dtype.
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
from fxshard.state.files import confined_file, regular_file
from fxshard.state.module_state import named_state
from fxshard.state.progress import progress
from fxshard.state.shards import assemble, runs_of

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_WHAT = "load_hf_checkpoint"


def checkpoint_files(path: str | os.PathLike) -> dict[str, Path]:
    """``{tensor name: file}`` of an HF checkpoint directory (sharded with an index, or
    one ``model.safetensors``), or of one ``.safetensors`` file; every file checked to be a
    regular file inside the directory, and the directory to have one layout (a PlanError
    names the file otherwise).

    Example: ``checkpoint_files("ckpt")  # {'model.embed_tokens.weight': PosixPath('ckpt/model-00001-of-00002.safetensors'), ...}``
    """
    path = Path(path)
    if not path.exists():
        raise PlanError(f"{_WHAT}: {path} does not exist\n  fix: the directory save_pretrained wrote, or one "
                        f".safetensors file")
    if not path.is_dir():
        files = [Path(regular_file(path, what=_WHAT))]
    elif (path / INDEX).exists():
        if (path / SINGLE).exists():
            raise PlanError(f"{_WHAT}: {path} has both {SINGLE} and {INDEX}: one process (from_pretrained) would "
                            f"read the one file and a mesh (fxshard's reader) the files the index names, maybe other "
                            f"weights\n  fix: remove the stale one ({path / INDEX} if {SINGLE} is the checkpoint, "
                            f"else {path / SINGLE})")
        index = Path(regular_file(path / INDEX, what=_WHAT))
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise PlanError(f"{_WHAT}: {index} is not an index of safetensors files ({type(e).__name__}: {e})\n  fix: "
                            f"write the checkpoint again with save_pretrained") from None
        resolved: dict[str, Path] = {}
        out = {}
        for name, f in weight_map.items():
            if f not in resolved:
                resolved[f] = Path(confined_file(path, f, what=f"{_WHAT}: {index} names"))
            out[name] = resolved[f]
        return out
    elif (path / SINGLE).exists():
        files = [Path(confined_file(path, SINGLE, what=f"{_WHAT}: {path}:"))]
    else:
        files = [Path(confined_file(path, f.name, what=f"{_WHAT}: {path}:")) for f in sorted(path.glob("*.safetensors"))]
        if not files:
            raise PlanError(f"{_WHAT}: no {INDEX}, {SINGLE} or *.safetensors in {path}\n  fix: the directory "
                            f"save_pretrained wrote (its safetensors files beside config.json)")
    out = {}
    for f in files:
        with _open(f) as st:
            out.update({name: f for name in st.keys()})
    return out


def _open(file: Path):
    """``safe_open(file)``; a file safetensors cannot read (truncated, a damaged header)
    is a PlanError naming it."""
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError, or an OSError: named with the file
        raise PlanError(f"{_WHAT}: {file} is not a readable safetensors file ({str(e).strip() or type(e).__name__}); "
                        f"was it truncated?\n  fix: copy or download the file again") from None


_FLOAT_STORED = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_STORED = {**_FLOAT_STORED, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def config_dtype(path: str | os.PathLike) -> torch.dtype | None:
    """The floating dtype ``config.json`` beside the weights says they are stored in
    (``dtype``, or ``torch_dtype`` of older configs), or ``None``."""
    path = Path(path)
    config = path / "config.json" if path.is_dir() else path.parent / "config.json"
    if not config.is_file():
        return None
    try:
        cfg = json.loads(config.read_text())
    except (ValueError, OSError, UnicodeDecodeError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype") if isinstance(cfg, dict) else None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def check_dtype(stored: str, want: torch.dtype, *, tensor: str, file, config: torch.dtype | None = None) -> None:
    """The conversion rule of :func:`load_hf_checkpoint`: ``stored`` (the safetensors
    header's dtype of ``tensor`` in ``file``) may be read into a tensor of dtype ``want``?
    A floating ``want`` takes F64/F32/F16/BF16, converted (and where the config names a
    dtype, the stored one is it or F32); any other ``want`` takes its own dtype only.  A
    PlanError otherwise.

    Example: ``check_dtype("BF16", torch.float32, tensor="lm_head.weight", file=f)  # converted: fine``
    """
    if want.is_floating_point:
        got = _FLOAT_STORED.get(stored)
        if got is None:
            raise PlanError(f"{_WHAT}: {tensor} is stored as {stored} in {file}, and the model's tensor is {want}: "
                            f"integer, bool, int8 and FP8 bytes are not read as floats (they would be a relabelling "
                            f"or a quantized checkpoint, converted silently into other numbers)\n  fix: load a "
                            f"checkpoint with floating weights (F32, BF16, F16), or dequantize it with the library "
                            f"that wrote it")
        if config is not None and got not in (config, torch.float32):
            raise PlanError(f"{_WHAT}: {tensor} is stored as {stored} in {file}, but its config.json says the "
                            f"weights are {config}: the header was relabelled or the config belongs to another "
                            f"checkpoint\n  fix: use the config.json the weights were saved with")
    elif _STORED.get(stored) != want:
        raise PlanError(f"{_WHAT}: {tensor} is stored as {stored} in {file}, the model's tensor is {want}: a "
                        f"non-floating tensor is read only in its own dtype\n  fix: is it this model's checkpoint?")


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
                handles[f] = stack.enter_context(_open(f))
            return handles[f]

        shapes, dtypes = {}, {}
        for name, f in files.items():
            try:
                piece = open_file(f).get_slice(name)
            except Exception as e:  # noqa: BLE001 - the index names a tensor the file lacks
                raise PlanError(f"{_WHAT}: {path}'s index puts {name} in {f}, which has no such tensor ({e})\n  fix: "
                                f"write the checkpoint again with save_pretrained") from None
            shapes[name], dtypes[name] = tuple(piece.get_shape()), piece.get_dtype()
        config = config_dtype(path)
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
                    for leaf in _leaves(source):
                        check_dtype(dtypes[leaf.name], target.dtype, tensor=leaf.name, file=leaf.file, config=config)
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


def _leaves(source: Source) -> list[Leaf]:
    return [source] if isinstance(source, Leaf) else [leaf for p in source.parts for leaf in _leaves(p)]


def _first_file(source: Source) -> Path:
    return source.file if isinstance(source, Leaf) else _first_file(source.parts[0])
