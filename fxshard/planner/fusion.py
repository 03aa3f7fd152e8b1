"""What a compiled program's kernels move: the eager program's ops, grouped as inductor fuses them.

``torch.compile`` with inductor (``fxshard.compile``, the trainer's ``--compile inductor``)
turns the elementwise and reduction ops between two matmuls into a few fused kernels: a
norm's upcast, square, mean, rsqrt and scale, a rotary embedding, SwiGLU's ``silu(g) * u``,
dropout and the residual add run as one kernel each, reading what they take from outside
once and writing only what leaves them, their intermediates held in registers.  On a GPU
those ops are bound by memory, so their time is their bytes; fusing them is most of what
compiling a transformer block buys (torchtitan's Llama-3.1-8B runs 1.16 times as many tokens
a second compiled).

:class:`FusedKernels` replays one forward's ops in order, as :mod:`fxshard.planner.offline`'s
counter sees them, and counts per unit the kernels and bytes of the fused program:

- a *barrier* (a matmul, attention, a collective) is a kernel of its own; each op after one
  starts a new *epoch* of its unit, and fused ops of different epochs never share a kernel
  (a matmul between them needs the first's result in memory);
- a fusible op joins the groups of the ops of its unit and epoch that made its inputs (a
  union-find of producer/consumer edges): each group is one kernel;
- a group reads each tensor it takes from outside itself once (a matmul's output, a
  parameter, an earlier group's result), and writes each result that something outside it
  reads (a barrier, another epoch or unit) or that nothing in the forward reads (the unit's
  results; what only the backward reads is written, as the eager program writes it).

Not modelled: what inductor's partitioner recomputes in the backward instead of saving (the
memory estimate stays the eager program's, an upper bound), and inductor's splits of a group
it cannot fuse (a reduction over another axis): one kernel a group is its best case.

Example::

    fused = FusedKernels()
    fused.barrier("<before>", [ids, table])           # as the counter dispatches ops
    fused.kernel("layers.0", [x, w], [y])
    fused.totals()                                     # {"layers.0": (bytes, kernels), ...}
"""
from __future__ import annotations

from typing import Iterable

import torch


class FusedKernels:
    """The fused kernels of one forward: fed each op in order, :meth:`totals` per unit."""

    def __init__(self):
        self.epoch: dict[str, int] = {}
        self.made: dict[int, tuple[str, int, int]] = {}  # storage -> (unit, epoch, group) of the fused op that made it
        self.size: dict[int, int] = {}  # storage -> bytes of what its maker wrote
        self.leaves: set[int] = set()  # storages something outside their maker's group reads
        self.read: set[int] = set()  # storages any op reads
        self.parent: list[int] = []  # union-find over groups
        self.unit_of: list[str] = []  # group -> its unit
        self.reads: dict[tuple[int, int], int] = {}  # (group, storage) -> bytes read from memory

    def barrier(self, unit: str, inputs: Iterable[torch.Tensor]) -> None:
        """An op that runs as its own kernel (a matmul, attention, a collective): what it
        reads from a fused group leaves that group, and ``unit`` starts a new epoch."""
        for t in inputs:
            key = storage_key(t)
            self.read.add(key)
            if key in self.made:
                self.leaves.add(key)
        self.epoch[unit] = self.epoch.get(unit, 0) + 1

    def kernel(self, unit: str, inputs: Iterable[torch.Tensor], outputs: Iterable[torch.Tensor]) -> None:
        """A fusible op (elementwise, a reduction, a copy, an indexing) of ``unit``."""
        group = len(self.parent)
        self.parent.append(group)
        self.unit_of.append(unit)
        epoch = self.epoch.get(unit, 0)
        for t in inputs:
            key = storage_key(t)
            self.read.add(key)
            maker = self.made.get(key)
            if maker is not None and maker[:2] == (unit, epoch):
                self._union(group, maker[2])  # made in registers by the same kernel
                continue
            if maker is not None:
                self.leaves.add(key)  # an earlier epoch's or unit's result: written there, read here
            self.reads[(group, key)] = max(self.reads.get((group, key), 0), tensor_bytes(t))
        for t in outputs:
            key = storage_key(t)
            self.made[key] = (unit, epoch, group)
            self.size[key] = max(self.size.get(key, 0), tensor_bytes(t))

    def totals(self) -> dict[str, tuple[int, int]]:
        """Per unit: (bytes read and written, kernels) of its fused groups."""
        moved: dict[str, int] = {}
        reads: dict[tuple[int, int], int] = {}
        for (group, key), nbytes in self.reads.items():  # a group reads a tensor once, however many of its ops do
            root = self._find(group)
            reads[(root, key)] = max(reads.get((root, key), 0), nbytes)
        for (root, _), nbytes in reads.items():
            unit = self.unit_of[root]
            moved[unit] = moved.get(unit, 0) + nbytes
        for key, (unit, _, _) in self.made.items():
            if key in self.leaves or key not in self.read:
                moved[unit] = moved.get(unit, 0) + self.size[key]
        kernels: dict[str, set[int]] = {}
        for group, unit in enumerate(self.unit_of):
            kernels.setdefault(unit, set()).add(self._find(group))
        return {unit: (moved.get(unit, 0), len(roots)) for unit, roots in kernels.items()}

    def _find(self, group: int) -> int:
        while self.parent[group] != group:
            self.parent[group] = self.parent[self.parent[group]]
            group = self.parent[group]
        return group

    def _union(self, a: int, b: int) -> None:
        self.parent[self._find(a)] = self._find(b)


def storage_key(t: torch.Tensor) -> int:
    """The identity of the storage under ``t`` (its views share it)."""
    return t.untyped_storage()._cdata


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s own elements (a view's, not its storage's)."""
    return t.numel() * t.element_size()
