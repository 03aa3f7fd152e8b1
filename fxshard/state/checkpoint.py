"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), loadable at
another mesh.

Example::

    fxshard.save(sharded, "ckpt/step100", optimizer=opt)       # every rank writes its shards
    ...                                                       # later, at tp=2, dp x tp or one device:
    fxshard.load(sharded_tp2, "ckpt/step100", optimizer=opt2)

What is stored is the *global* tensor of every model FQN and of every optimizer
state that has a parameter's shape (AdamW's ``exp_avg``, ``exp_avg_sq``): each rank
writes the boxes of its shard (:mod:`fxshard.shards`; one per part of a fused
projection) with their global offsets, replicas are written once (DCP deduplicates
equal boxes).  Loading asks DCP for the boxes of the *loading* model's shards, so DCP
reads each from whichever files hold it: a checkpoint saved at tp=4 loads at tp=2, dp x
tp, or into the plain single-device model (no process group).  Keys:
``model.<fqn>``, ``optim.state.<fqn>.<name>``, ``optim.param_groups`` (parameters by
FQN), so a checkpoint is readable with DCP's own tools.

Nothing in a checkpoint is run when it is loaded: a checkpoint may come from elsewhere, and
unpickling runs whatever the pickle names.  Everything that is not a tensor's bytes is
plain data (what ``torch.load(weights_only=True)`` loads: dicts, lists, tuples, strings,
numbers, ``None``, tensors), refused at :func:`save` otherwise; :func:`load` reads the
``state`` files and DCP's pickled values with ``weights_only=True`` and DCP's
``.metadata`` (a pickle, which torch's ``FileSystemReader`` reads with ``pickle.load``)
with an unpickler that builds DCP's metadata classes and nothing else.

Nothing outside the checkpoint is read, and nothing is loaded that does not check out
(everything below is checked before the first tensor is written to): every file the
``.metadata`` names is a regular file inside the checkpoint's directory
(:func:`fxshard.state.files.confined_file`) and a file the commit file lists; every
tensor's stored chunks cover it exactly once; the model's keys, global shapes and dtypes
are the checkpoint's (``strict=False`` lets keys be missing or extra); each rank's
``state.<rank>.pt`` is there for the world size the commit file records; and the size and
SHA-256 of every file the commit file lists are what :func:`save` wrote
(``check_digests=False`` skips the digests).  Any of it is a PlanError naming the file.
"""
from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import shutil
from typing import Any

import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from fxshard.runtime import collectives
from fxshard.errors import PlanError
from fxshard.meta import pipeline_of, program_meta
from fxshard.state.files import DIGEST, confined_file, file_digest, regular_file
from fxshard.state.module_state import named_state
from fxshard.state.progress import progress
from fxshard.state.shards import Runs, boxes, runs_of


class ShardView:
    """A rank's local tensor as DCP sees it: the global size, and the boxes this rank
    holds (``__create_write_items__`` / ``__create_chunk_list__`` /
    ``__get_tensor_shard__``, the protocol DTensor implements)."""

    def __init__(self, local: torch.Tensor, runs: Runs, global_shape):
        self.local, self.global_size = local, torch.Size(global_shape)
        self.boxes = {torch.Size(b.offsets): b for b in boxes(runs)}

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(b.sizes)),
                                                      properties=props, size=self.global_size))
                for off, b in self.boxes.items()]

    def size(self) -> torch.Size:
        return self.global_size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=torch.Size(b.sizes)) for off, b in self.boxes.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local[self.boxes[torch.Size(index.offset)].local]


class _SavePlanner(DefaultSavePlanner):
    """DCP looks objects up by tensor type; a ShardView answers for its boxes.  The
    progress bar counts this rank's write items."""

    def __init__(self, bar):
        super().__init__()
        self.bar = bar

    def finish_plan(self, new_plan):
        self.bar.reset(total=len(new_plan.items))
        return super().finish_plan(new_plan)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, ShardView) else super().lookup_object(index)

    def resolve_data(self, write_item):
        self.bar.update(1)
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self, bar, path: str):
        super().__init__()
        self.bar, self.path = bar, path

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's first step re-allocates meta tensors and drops any other
        # object (a ShardView) to None; fxshard.load refuses meta tensors itself
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def finish_plan(self, new_plan):
        self.bar.reset(total=len(new_plan.items))
        return super().finish_plan(new_plan)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, ShardView) else super().lookup_tensor(index)

    def commit_tensor(self, read_item, tensor) -> None:
        self.bar.update(1)
        super().commit_tensor(read_item, tensor)

    def load_bytes(self, read_item, value) -> None:
        # DefaultLoadPlanner reads a pickled value with torch.load(weights_only=False), which runs its pickle
        self.bar.update(1)
        fqn = read_item.dest_index.fqn
        obj = _load_plain(value, f"the value {fqn!r} in {self.path}")
        set_element(self.original_state_dict, self.mappings[fqn], obj)


_METADATA_GLOBALS = {
    # what DCP's .metadata pickles (torch 2.13): its metadata classes, the file reader's record of where each
    # item is, torch's size, dtypes and layouts, and the checkpoint id a save was given (a path)
    *((dcp_metadata.__name__, name) for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                                                 "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta",
                                                 "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds DCP's metadata classes only: any other global a
    pickle names (``os.system``, ``builtins.eval``) is refused before it is looked up."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a part of DCP's metadata")


class _SafeReader(dcp.FileSystemReader):
    """DCP's ``FileSystemReader`` reading ``.metadata`` with :class:`_MetadataUnpickler`
    (torch's reads it with ``pickle.load``: a tampered file would run its pickle), checking
    it (:func:`_check_metadata`: every file it names is a regular file inside the
    checkpoint, every tensor covered once) and keeping it, so DCP reads what was checked.
    ``listed``: the files the commit file lists (``None``: an older checkpoint's, unlisted)."""

    def __init__(self, path: str, listed: dict | None = None):
        super().__init__(path)
        self.checkpoint, self.listed, self.metadata = path, listed, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self.metadata is None:
            path = regular_file(self._get_metadata_path(kwargs.get("rank")), what="fxshard.load")
            with self.fs.create_stream(path, "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except Exception as e:  # noqa: BLE001 - whatever the bytes make the unpickler raise
                    raise _not_plain(path, e) from None
            if not isinstance(metadata, dcp_metadata.Metadata):
                raise _not_plain(path, TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata"))
            _check_metadata(self.checkpoint, os.fspath(path), metadata, self.listed)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp_metadata.StorageMeta()
            self.metadata = metadata
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except PlanError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever a damaged file makes torch raise: named with its file
            files = sorted({self.storage_data[i.storage_index].relative_path for i in plan.items})
            where = os.path.join(self.checkpoint, files[0]) if len(files) == 1 else f"one of {files} in {self.checkpoint}"
            raise PlanError(f"fxshard.load: {where} does not read as the .metadata says ({type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); the checkpoint is damaged"
                            f"\n  fix: copy the checkpoint again from where it was written, or load an older one") from None


def _damaged(where: str, problem: str) -> PlanError:
    return PlanError(f"fxshard.load: {where}: {problem}; nothing was loaded\n  fix: the checkpoint is damaged or was "
                     f"tampered with: copy it again from where it was written, or load an older one")


def _check_metadata(path: str, where: str, metadata, listed: dict | None) -> None:
    """Every piece ``metadata`` stores is in a regular file inside ``path`` (one the commit
    file lists, where it lists them), within that file's bytes; every tensor's chunks cover
    it exactly once; every chunk and value has its stored piece."""
    storage, entries = metadata.storage_data, metadata.state_dict_metadata
    if not isinstance(storage, dict) or not isinstance(entries, dict):
        raise _damaged(where, "its index of stored pieces is not DCP's")
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise _damaged(where, f"it lists a {type(info).__name__} where DCP's file reader records a piece")
        rel = info.relative_path
        if rel not in sizes:
            file = confined_file(path, rel, what=f"fxshard.load: {where} names")
            if listed is not None and rel not in listed:
                raise _damaged(where, f"it names {rel!r}, a file the checkpoint's {COMMIT_FILE} does not list")
            sizes[rel] = os.stat(file).st_size
            if listed is not None and sizes[rel] != listed[rel]["size"]:
                raise PlanError(f"fxshard.load: {file} has {sizes[rel]} bytes, {listed[rel]['size']} were written: it "
                                f"was truncated or changed after the save; nothing was loaded\n  fix: copy the "
                                f"checkpoint again from where it was written, or load an older one")
        off, n = info.offset, info.length
        if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and 0 <= n and off + n <= sizes[rel]):
            raise _damaged(where, f"the piece of {index.fqn!r} is at bytes {off}..{off}+{n} of {rel!r}, which has "
                                  f"{sizes[rel]} bytes")
    for fqn, md in entries.items():
        if isinstance(md, TensorStorageMetadata):
            _check_chunks(where, fqn, md)
            for c in md.chunks:
                if MetadataIndex(fqn, c.offsets) not in storage:
                    raise _damaged(where, f"the chunk of {fqn!r} at {tuple(c.offsets)} has no stored bytes")
        elif MetadataIndex(fqn) not in storage:
            raise _damaged(where, f"the value {fqn!r} has no stored bytes")


def _check_chunks(where: str, fqn: str, md: TensorStorageMetadata) -> None:
    """The chunks of a tensor are boxes inside it that cover it exactly once: their
    volumes add up to its size and no two overlap (a missing, half or overlapping chunk
    would leave elements at their old values, or load them twice)."""
    size = tuple(md.size)
    boxes, total = [], 0
    for c in md.chunks:
        off, sz = tuple(c.offsets), tuple(c.sizes)
        if len(off) != len(size) or len(sz) != len(size) or \
                any(o < 0 or s < 0 or o + s > n for o, s, n in zip(off, sz, size)):
            raise _damaged(where, f"{fqn!r} of shape {size} has a chunk at {off} of shape {sz}, outside it")
        volume = math.prod(sz)
        total += volume
        if volume:
            boxes.append((off, tuple(o + s for o, s in zip(off, sz))))
    boxes.sort()
    for i, (lo, hi) in enumerate(boxes):
        for lo2, hi2 in boxes[i + 1:]:
            if size and lo2[0] >= hi[0]:
                break  # sorted by the first offset: no later box reaches back into this one
            if all(a < d and c < b for a, b, c, d in zip(lo, hi, lo2, hi2)):
                raise _damaged(where, f"{fqn!r} has overlapping chunks at {lo} and {lo2}")
    if total != math.prod(size):
        raise _damaged(where, f"the chunks of {fqn!r} (shape {size}) hold {total} of its {math.prod(size)} elements "
                              f"(a chunk is missing)")


def _not_plain(what, error: BaseException) -> PlanError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return PlanError(f"fxshard.load: {os.fspath(what) if isinstance(what, os.PathLike) else what} does not load as plain "
                     f"data ({reason}); it may have been tampered with, or written by an fxshard older than this one "
                     f"(which pickled any object); it was not run\n  fix: load checkpoints only from a source you "
                     f"trust; one you wrote yourself with an older fxshard: read it once with torch.load(..., "
                     f"weights_only=False) and save its values again as plain data")


def _load_plain(source, what: str):
    """``torch.load(source, weights_only=True)``: tensors and plain containers, never a
    pickle's code; anything else is a PlanError naming ``what``."""
    try:
        return torch.load(source, weights_only=True)
    except Exception as e:  # noqa: BLE001 - an UnpicklingError, or whatever the bytes make torch raise
        raise _not_plain(what, e) from None


def _loads_plain(obj) -> bool:
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
        return True
    except Exception:  # noqa: BLE001
        return False


def _first_not_plain(obj, path: str) -> tuple[str, type] | None:
    """The path and type of the first value in ``obj`` that ``torch.load(weights_only=True)``
    would refuse, or ``None`` (each level is checked by a round trip through torch, the
    ground truth; only the way down to a refused value is walked)."""
    if _loads_plain(obj):
        return None
    if isinstance(obj, dict):
        children = ((f"{path}[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set)):
        children = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    else:
        children = iter(())
    for child_path, v in children:
        found = _first_not_plain(v, child_path)
        if found is not None:
            return found
    return path, type(obj)  # the container itself (a defaultdict, a namedtuple), or a leaf


def _views(module: nn.Module) -> tuple[dict[str, ShardView], dict[int, str]]:
    """``{fqn: ShardView}`` of ``module``'s persistent state (a transformed
    GraphModule's shards, or a plain module's whole tensors) and ``{id(param): fqn}``
    (a tied tensor's first name)."""
    layouts = program_meta(module).state
    transformed = layouts is not None
    mesh = collectives.bound_mesh() if transformed else None
    persistent = set(module.state_dict().keys())
    views, names = {}, {}
    for fqn, t, is_param in named_state(module):
        if fqn not in persistent:
            continue
        names.setdefault(id(t), fqn)
        local = t.detach()
        local_data = local.to_local() if hasattr(local, "to_local") else local  # FSDP2: its shard of fxshard's
        if transformed:
            runs = runs_of(module, fqn, mesh, local)
            shape = layouts.get(fqn, (None, tuple(local.shape)))[1]
        else:
            runs, shape = [[(0, s)] for s in local.shape], tuple(local.shape)
        views[fqn] = ShardView(local_data, runs, shape)
    return views, names


def _state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    views, names = _views(module)
    sd: dict[str, Any] = {f"model.{k}": v for k, v in views.items()}
    if optimizer is not None:
        groups = []
        for g in optimizer.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]})
            for p in g["params"]:
                fqn = names[id(p)]
                for key, value in optimizer.state.get(p, {}).items():
                    sd[f"optim.state.{fqn}.{key}"] = _like_param(value, p, views[fqn])
        sd["optim.param_groups"] = tuple(groups)  # a tuple is one DCP entry (a list would be traversed)
    return sd


def _like_param(value, p: torch.Tensor, view: ShardView):
    """An optimizer state of the parameter's local shape is sharded as the parameter.
    Under FSDP2 the state is a DTensor like the parameter: its local piece is the one the
    parameter's view describes (written as a DTensor, it would be the tp-local tensor under
    one key from every tp rank)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    if isinstance(local, torch.Tensor) and local.shape == view.local.shape and local.dim() > 0:
        return ShardView(local, [[(o, n) for o, n in dim] for dim in _runs_of_view(view)], view.global_size)
    return value


def _runs_of_view(view: ShardView) -> Runs:
    """The runs back from a view's boxes (they form a box product, see fxshard.shards)."""
    per_dim: list[dict[int, tuple[int, int]]] = [dict() for _ in view.global_size]
    for b in view.boxes.values():
        for d, (g, loc) in enumerate(zip(b.glob, b.local)):
            per_dim[d][loc.start] = (g.start, g.stop - g.start)
    return [[r for _, r in sorted(dim.items())] for dim in per_dim]


def _single_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


COMMIT_FILE = "fxshard_commit.json"  # written last: a checkpoint without it is not one
_STAGING, _REPLACED = ".partial", ".replaced"


def save(module: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None, *,
         state: dict | None = None, keep_last: int | None = None, digest: bool = True,
         show_progress: bool | None = None) -> None:
    """Save ``module``'s shards (and ``optimizer``'s state) as a DCP checkpoint in
    ``path``.  A collective: every rank of the mesh calls it.

    ``state``: anything else the run needs to resume (step, LR scheduler, RNG states, data
    position), each rank's own, returned by :func:`load`.  The checkpoint is written into
    ``path + ".partial"`` and made visible as ``path`` in one rename once every rank has
    written its part, so a rank killed mid-save leaves no ``path`` behind and
    :func:`latest_checkpoint` returns the last one committed.  ``keep_last=k``: the ``k``
    newest committed checkpoints beside ``path`` are kept, older ones deleted.  The commit
    file lists every file written with its size and, unless ``digest=False`` (very large
    checkpoints: the digests read every byte once more, split over the ranks), its SHA-256,
    which :func:`load` checks.

    Example::

        fxshard.save(sharded, f"ckpt/step{step}", optimizer=opt, keep_last=2,
                     state={"step": step, "sched": sched.state_dict(), "rng": torch.get_rng_state()})
    """
    if keep_last is not None and keep_last < 1:
        raise PlanError(f"fxshard.save(keep_last={keep_last}): keep at least the checkpoint just written (keep_last >= 1)")
    path = os.fspath(path)
    staging = path + _STAGING
    rank = _rank()
    sd = _state_dict(module, optimizer)
    # only plain data, which load reads without running anything; checked on every rank before anything is written
    device = next((t.device for t in [*module.parameters(), *module.buffers()]), torch.device("cpu"))
    state_bytes = _plain_bytes(state, sd, optimizer, device)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what a save killed earlier left
        os.makedirs(staging)
    _barrier()
    if state_bytes is not None:
        with open(os.path.join(staging, f"state.{rank}.pt"), "wb") as f:
            f.write(state_bytes)
    bar = progress(None, f"saving to {path}", show_progress, unit="piece")
    try:
        # returns once the coordinator has written the metadata, i.e. after every rank's data
        dcp.save(sd, checkpoint_id=staging, planner=_SavePlanner(bar), no_dist=_single_process())
    finally:
        bar.close()
    _barrier()  # every rank's state file too
    _list_files(staging, rank, digest)
    _barrier()
    if rank == 0:
        _commit(staging, path)
        if keep_last is not None:
            _keep_last(os.path.dirname(os.path.abspath(path)), keep_last)
    _barrier()


def _plain_bytes(state: dict | None, sd: dict[str, Any], optimizer, device: torch.device) -> bytes | None:
    """``state`` as ``torch.save`` writes it, once every value DCP pickles (``state``, the
    optimizer's hyperparameters and any state of its that is no tensor) is known to load with
    ``torch.load(weights_only=True)``; else a PlanError naming the first that would not, on
    every rank (a refusal on one rank alone would leave the others waiting at a barrier)."""
    problem = None
    state_bytes = None
    if state is not None:
        buf = io.BytesIO()
        try:
            torch.save(state, buf)
            state_bytes = buf.getvalue()
            torch.load(io.BytesIO(state_bytes), weights_only=True)
        except Exception:  # noqa: BLE001 - the walk names the value (one that does not pickle at all, too)
            problem = _first_not_plain(state, "state") or ("state", type(state))
    if problem is None and optimizer is not None:
        for key, value in sd.items():
            if isinstance(value, (ShardView, torch.Tensor)) or not key.startswith("optim."):
                continue
            where = "optimizer.param_groups" if key == "optim.param_groups" else \
                f"the optimizer's state {key[len('optim.state.'):]!r}"
            problem = _first_not_plain(value, where)
            if problem is not None:
                break
    refusing = _ranks_with(problem is not None, device)
    if problem is not None:
        where, kind = problem
        raise PlanError(f"fxshard.save: {where} is a {kind.__module__}.{kind.__qualname__}, which a checkpoint does not "
                        f"store: fxshard.load reads only plain data (dicts, lists, tuples, strings, numbers, None, "
                        f"tensors), so that loading a checkpoint never runs code from it\n  fix: save its plain state "
                        f"instead: obj.state_dict() for an object that has one (an LR scheduler, a data loader), or "
                        f"its values in a dict")
    if refusing:
        raise PlanError(f"fxshard.save: rank(s) {refusing} refused a value that is not plain data (their error names "
                        f"it); nothing was written")
    return state_bytes


def _ranks_with(flag: bool, device: torch.device) -> list[int]:
    """The ranks on which ``flag`` is set (one all-reduce; ``[]`` or ``[0]`` without a
    process group)."""
    if _single_process():
        return [0] if flag else []
    import torch.distributed as dist

    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[dist.get_rank()] = int(flag)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest checkpoint that :func:`save` committed in the folder ``root`` (``None``
    if there is none); partial ones (a save that did not finish on every rank) are skipped.

    Example: ``path = fxshard.latest_checkpoint("ckpt"); state = fxshard.load(sharded, path, opt) if path else None``
    """
    found = _committed(os.fspath(root))
    return found[-1][1] if found else None


_LISTING = "fxshard_files."  # each rank's share of the listing, merged into the commit file


def _list_files(staging: str, rank: int, digest: bool) -> None:
    """Each rank records the size (and digest) of its share of the written files (every
    ``world_size``-th, by name) in ``fxshard_files.<rank>.json``."""
    world = _world_size()
    names = sorted(n for n in os.listdir(staging) if not n.startswith(_LISTING) and n != COMMIT_FILE)
    mine = {n: {"size": os.path.getsize(os.path.join(staging, n)),
                DIGEST: file_digest(os.path.join(staging, n)) if digest else None} for n in names[rank::world]}
    with open(os.path.join(staging, f"{_LISTING}{rank}.json"), "w") as f:
        json.dump(mine, f)


def _commit(staging: str, path: str) -> None:
    root = os.path.dirname(os.path.abspath(path))
    seq = max((s for s, _ in _committed(root)), default=0) + 1
    files: dict[str, dict] = {}
    for name in sorted(os.listdir(staging)):
        if name.startswith(_LISTING):
            with open(os.path.join(staging, name)) as f:
                files.update(json.load(f))
            os.remove(os.path.join(staging, name))
    with open(os.path.join(staging, COMMIT_FILE), "w") as f:
        json.dump({"seq": seq, "world_size": _world_size(), "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):  # saved again under the same name: the old one goes only once the new one is there
        os.rename(path, path + _REPLACED)
    os.rename(staging, path)
    shutil.rmtree(path + _REPLACED, ignore_errors=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable
    finally:
        os.close(fd)


def _committed(root: str) -> list[tuple[int, str]]:
    """``[(seq, path)]`` of the committed checkpoints in ``root``, oldest first."""
    out = []
    if not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        marker = os.path.join(root, name, COMMIT_FILE)
        if name.endswith((_STAGING, _REPLACED)) or not os.path.isfile(marker):
            continue
        try:
            with open(marker) as f:
                out.append((int(json.load(f)["seq"]), os.path.join(root, name)))
        except (ValueError, KeyError, OSError):
            continue
    return sorted(out)


def _keep_last(root: str, k: int) -> None:
    for _, old in _committed(root)[:-k]:
        shutil.rmtree(old, ignore_errors=True)


def _rank() -> int:
    import torch.distributed as dist

    return 0 if _single_process() else dist.get_rank()


def _world_size() -> int:
    import torch.distributed as dist

    return 1 if _single_process() else dist.get_world_size()


def _barrier() -> None:
    import torch.distributed as dist

    if not _single_process():
        dist.barrier()


def load(module: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None, *,
         strict: bool = True, check_digests: bool = True, show_progress: bool | None = None) -> dict | None:
    """Load a checkpoint written by :func:`save` at any mesh into ``module``'s shards
    (in place) and ``optimizer``'s state; returns the ``state`` saved with it (this
    rank's, or rank 0's when the checkpoint was written by fewer ranks), or ``None``.  A
    collective on a transformed module; on a plain single-device module it needs no
    process group.

    Everything is checked before anything is loaded (see the module's docstring): a
    PlanError names the file.  ``strict``: the model's tensors and the checkpoint's are the
    same keys (``strict=False``: a tensor the checkpoint lacks keeps its value, one the
    model lacks is skipped).  ``check_digests=False``: the files' sizes are checked, their
    SHA-256 not (a very large checkpoint, read from storage you trust).

    Example: ``state = fxshard.load(sharded, fxshard.latest_checkpoint("ckpt"), optimizer=opt)``
    """
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, COMMIT_FILE)):
        partial = os.path.isdir(path + _STAGING) or os.path.isdir(path)
        raise PlanError(f"fxshard.load: {path} is not a committed checkpoint"
                        f"{' (its save did not finish on every rank)' if partial else ' (no such folder)'}: it has no "
                        f"{COMMIT_FILE}\n  fix: load fxshard.latest_checkpoint({os.path.dirname(path) or '.'!r}), the newest "
                        f"checkpoint every rank finished")
    commit = _read_commit(path)
    listed = commit.get("files")
    reader = _SafeReader(path, listed)
    saved = reader.read_metadata().state_dict_metadata
    views, names = _views(module)
    on_meta = [k for k, v in views.items() if v.local.is_meta]
    if on_meta:
        raise PlanError(f"fxshard.load: {on_meta[:4]} are on the meta device; call fxshard.materialize(sharded, "
                        f"model, device=..., init=None) first")
    missing = [k for k in views if f"model.{k}" not in saved]
    if missing and strict:
        raise PlanError(f"fxshard.load: {path} has no {missing[:8]}{' ...' if len(missing) > 8 else ''}; was it "
                        f"saved from this model?\n  fix: load the checkpoint of this model; strict=False keeps "
                        f"their current values")
    unexpected = sorted(_saved_model_keys(saved) - _model_keys(module, views))
    if unexpected and strict:
        raise PlanError(f"fxshard.load: {path} has tensors the model does not: {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''}; was it saved from this model (another config, more "
                        f"layers)?\n  fix: load the checkpoint of this model; strict=False skips them")
    for fqn, v in views.items():
        md = saved.get(f"model.{fqn}")
        if md is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise PlanError(f"fxshard.load: {fqn} is a pickled value in {path}, not a tensor")
        if tuple(md.size) != tuple(v.global_size):
            raise PlanError(f"fxshard.load: {fqn} has the global shape {tuple(md.size)} in {path}, the model's is "
                            f"{tuple(v.global_size)}")
        if md.properties.dtype != v.local.dtype:
            raise PlanError(f"fxshard.load: {fqn} is {md.properties.dtype} in {path}, the model's is "
                            f"{v.local.dtype}; fxshard.load does not convert\n  fix: load into the model in "
                            f"{md.properties.dtype} (model.to(dtype)) and convert it afterwards")
    device = next((v.local.device for v in views.values()), torch.device("cpu"))
    state_file = _state_file(path, commit, listed)
    _check_files(path, listed, check_digests, device)
    sd: dict[str, Any] = {f"model.{k}": v for k, v in views.items() if f"model.{k}" in saved}
    aliases = _aliases(module)
    if optimizer is not None:
        sd.update(_optimizer_targets(optimizer, views, names, aliases, saved))
    bar = progress(None, f"loading {os.fspath(path)}", show_progress, unit="piece")
    try:
        dcp.load(sd, checkpoint_id=path, storage_reader=reader, planner=_LoadPlanner(bar, path),
                 no_dist=_single_process())
    except CheckpointException as e:  # DCP gathers each rank's exception: fxshard's own is the error to show
        refused = next((exc for exc, _ in e.failures.values() if isinstance(exc, PlanError)), None)
        if refused is not None:
            raise refused from None
        ranks = sorted(e.failures)
        exc = e.failures[ranks[0]][0]
        raise PlanError(f"fxshard.load: reading {path} failed on rank(s) {ranks}: {type(exc).__name__}: "
                        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n  fix: is the checkpoint "
                        f"complete and readable by every rank? copy it again from where it was written") from None
    finally:
        bar.close()
    if optimizer is not None:
        _restore_optimizer(optimizer, names, aliases, sd)
    return _load_plain(state_file, state_file) if state_file is not None else None


def _read_commit(path: str) -> dict:
    """The commit file, checked: a dict with the saving world size (and, written by this
    fxshard, the files with their sizes and digests)."""
    where = regular_file(os.path.join(path, COMMIT_FILE), what="fxshard.load")
    try:
        with open(where) as f:
            commit = json.load(f)
    except (ValueError, OSError) as e:
        raise _damaged(where, f"it is not JSON ({e})") from None
    world = commit.get("world_size") if isinstance(commit, dict) else None
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise _damaged(where, "it records no world size (a number of ranks)")
    files = commit.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("size"), int) for v in files.values())):
        raise _damaged(where, "its list of files is not the one fxshard.save writes")
    return commit


_STATE_FILE = re.compile(r"state\.(\d+)\.pt")


def _state_file(path: str, commit: dict, listed: dict | None) -> str | None:
    """The ``state.<rank>.pt`` this rank reads (rank 0's beyond the saving world size), or
    ``None`` if the save had no ``state``; a PlanError naming the ones missing when the
    save wrote them (each rank its own) and some are not there."""
    world = commit["world_size"]
    names = set(listed) if listed is not None else set(os.listdir(path))
    ranks = {int(m.group(1)) for m in map(_STATE_FILE.fullmatch, names) if m}
    if not ranks:
        return None
    absent = [f"state.{r}.pt" for r in range(world)
              if r not in ranks or not os.path.lexists(os.path.join(path, f"state.{r}.pt"))]
    if absent:
        raise PlanError(f"fxshard.load: {path} was saved by {world} ranks, each with its state file, and "
                        f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} missing: a rank would resume with "
                        f"another's state; nothing was loaded\n  fix: copy the checkpoint again with all its files, "
                        f"or load an older one")
    name = f"state.{_rank() if _rank() < world else 0}.pt"
    return confined_file(path, name, what=f"fxshard.load: {path}")


def _check_files(path: str, listed: dict | None, check_digests: bool, device: torch.device) -> None:
    """Every file the commit file lists is a regular file of its recorded size and (with
    ``check_digests``) digest; the digests are split over the ranks (every ``world``-th
    file), a failure on any rank refused on all.  An older checkpoint lists none."""
    if listed is None:
        return
    problem: PlanError | None = None
    fix = ("; nothing was loaded\n  fix: copy the checkpoint again from where it was written, or load an older one "
           "(check_digests=False skips the digests, not the sizes)")
    for i, name in enumerate(sorted(listed)):
        try:
            file = confined_file(path, name, what=f"fxshard.load: {os.path.join(path, COMMIT_FILE)} lists")
        except PlanError as e:
            problem = problem or e
            continue
        want = listed[name]
        size = os.stat(file).st_size
        if size != want["size"]:
            problem = problem or PlanError(f"fxshard.load: {file} has {size} bytes, {want['size']} were written: it "
                                           f"was truncated or changed after the save{fix}")
        elif check_digests and want.get(DIGEST) and i % _world_size() == _rank() and file_digest(file) != want[DIGEST]:
            problem = problem or PlanError(f"fxshard.load: {file} is not the file that was written (its {DIGEST} "
                                           f"differs from the one in {COMMIT_FILE}): it was changed or damaged after "
                                           f"the save{fix}")
    refusing = _ranks_with(problem is not None, device)
    if problem is not None:
        raise problem
    if refusing:
        raise PlanError(f"fxshard.load: rank(s) {refusing} found a damaged file in {path} (their error names it); "
                        f"nothing was loaded")


def _saved_model_keys(saved) -> set[str]:
    return {k[len("model."):] for k in saved if k.startswith("model.")}


def _model_keys(module: nn.Module, views: dict) -> set[str]:
    """The persistent tensors of the whole model: a pipeline stage's, with those of the
    other stages (gathered over the pipeline's ranks)."""
    keys = set(views)
    if pipeline_of(module) is not None and not _single_process() and getattr(module, "pp_group", None) is not None:
        import torch.distributed as dist

        every: list = [None] * dist.get_world_size(module.pp_group)
        dist.all_gather_object(every, sorted(keys), group=module.pp_group)
        keys = set().union(*map(set, every))
    return keys


def _aliases(module: nn.Module) -> dict[str, str]:
    """``{name: first name}`` of every persistent tensor: a tied tensor's optimizer state is
    stored under its first name in the saving module, which may be another of its names here
    (a model saved whole, loaded into a program that registers the head first)."""
    persistent = set(module.state_dict().keys())
    first: dict[int, str] = {}
    return {fqn: first.setdefault(id(t), fqn) for fqn, t, _ in named_state(module) if fqn in persistent}


def _optimizer_targets(optimizer, views, names, aliases, saved) -> dict[str, Any]:
    """Tensors to load the saved optimizer state into: a parameter-shaped state in the
    parameter's shards, any other tensor (AdamW's ``step``) whole; found under whichever of
    a tied parameter's names the checkpoint used."""
    if "optim.param_groups" not in saved:
        raise PlanError("fxshard.load: the checkpoint has no optimizer state (saved without optimizer=)")
    out: dict[str, Any] = {"optim.param_groups": ()}
    for g in optimizer.param_groups:
        for p in g["params"]:
            fqn = names[id(p)]
            for name in [fqn] + [a for a, first in aliases.items() if first == fqn and a != fqn]:
                prefix = f"optim.state.{name}."
                if any(k.startswith(prefix) for k in saved):
                    break
            for key, md in ((k[len(prefix):], m) for k, m in saved.items() if k.startswith(prefix)):
                if isinstance(md, TensorStorageMetadata):
                    dtype = md.properties.dtype
                    if tuple(md.size) == tuple(views[fqn].global_size) and len(md.size) > 0:
                        local = torch.zeros(views[fqn].local.shape, dtype=dtype, device=p.device)
                        out[prefix + key] = ShardView(local, _runs_of_view(views[fqn]), views[fqn].global_size)
                    else:
                        out[prefix + key] = torch.zeros(tuple(md.size), dtype=dtype)
                else:
                    out[prefix + key] = None  # bytes: DCP fills in the object
    return out


def _restore_optimizer(optimizer, names, aliases, sd) -> None:
    index, params = {}, {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            index[names[id(p)]] = len(index)
            params[names[id(p)]] = p
    state: dict[int, dict] = {}
    for k, v in sd.items():
        if not k.startswith("optim.state."):
            continue
        name, _, key = k[len("optim.state."):].rpartition(".")
        fqn = aliases.get(name, name)  # the state found under a tied parameter's other name
        if isinstance(v, ShardView):
            p = params[fqn]
            # under FSDP2 the optimizer steps on DTensors: its state is one too, laid out as the parameter
            v = DTensor.from_local(v.local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()) \
                if isinstance(p, DTensor) else v.local
        state.setdefault(index[fqn], {})[key] = v
    groups = []
    for g, saved in zip(optimizer.param_groups, sd["optim.param_groups"]):
        # this optimizer's own parameters: the saved group may list others (one device's, loaded by a pipeline
        # stage) or fewer (the group one pipeline rank wrote); each one's state is found above by its FQN
        groups.append({**saved, "params": [index[names[id(p)]] for p in g["params"]]})
    if len(groups) != len(optimizer.param_groups):
        raise PlanError(f"fxshard.load: the checkpoint has {len(groups)} parameter groups, the optimizer "
                        f"{len(optimizer.param_groups)}")
    optimizer.load_state_dict({"state": state, "param_groups": groups})
