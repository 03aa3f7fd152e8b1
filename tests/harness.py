"""Test harnesses: real ranks (processes + gloo) and simulated ranks (LocalTensorMode).

Real ranks prove the runtime path; simulated ranks run in one process and are
fast enough for wide sweeps.

Real processes::

    def _check(rank, world_size, n):          # top level, so it pickles
        mesh = make_mesh({"tp": world_size})
        ...                                   # raise/assert on failure

    def test_it():
        spawn(_check, 2, 7)

Simulated ranks::

    with simulated({"dp": 2, "tp": 2}) as mesh:
        x = rank_map(lambda r: torch.full((2,), float(r)))   # one tensor per rank
        y = f(x)
        for r in ranks_of(y):
            torch.testing.assert_close(rank_value(y, r), expected[r])
"""
from __future__ import annotations

import contextlib
import math
import multiprocessing.connection
import os
import pickle
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fxshard.testing.launch import free_port, run_rank

__all__ = ["free_port", "spawn", "simulated", "rank_map", "rank_value", "ranks_of", "make_mesh", "plain"]

SPAWN_TIMEOUT_S = float(os.environ.get("FXSHARD_SPAWN_TIMEOUT", "300"))


def spawn(fn: Callable, world_size: int, *args, timeout: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes over gloo.

    ``fn`` must be a picklable top-level function (so must ``args``).  The process
    group is initialised before ``fn`` and destroyed after it.  If any rank fails,
    the others get a moment to fail too (a peer's error often makes them fail), the
    rest are killed, and ``torch.multiprocessing.ProcessRaisedException`` is raised
    with the traceback of every failed rank.  Ranks still running after ``timeout``
    seconds (default ``$FXSHARD_SPAWN_TIMEOUT`` or 300) are killed: ``TimeoutError``.
    """
    for attempt in range(3):
        try:
            return _spawn_once(fn, world_size, args, timeout)
        except mp.ProcessRaisedException as e:
            # free_port's port was taken by another test's ranks before rank 0 listened on it (the
            # workers of pytest -n race for ports): nothing ran yet, so the ranks start again
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def _spawn_once(fn: Callable, world_size: int, args: tuple, timeout: float | None) -> None:
    timeout = SPAWN_TIMEOUT_S if timeout is None else timeout
    name = getattr(fn, "__qualname__", repr(fn))
    port = free_port()
    ctx = mp.spawn(run_rank, args=(fn, world_size, port, args), nprocs=world_size, join=False, start_method="spawn")
    procs = ctx.processes
    deadline = time.monotonic() + timeout
    try:
        while True:
            alive = [p for p in procs if p.is_alive()]
            failed = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
            if failed or not alive:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"spawn({name}, {world_size}): ranks still running after {timeout:.0f} s")
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=1.0)
        if failed:
            grace_end = time.monotonic() + 3.0
            for p in procs:
                p.join(timeout=max(0.0, grace_end - time.monotonic()))
            failed = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
            parts = []
            for i in failed:
                path = ctx.error_files[i]
                if path and os.path.exists(path) and os.path.getsize(path) > 0:
                    with open(path, "rb") as fh:
                        parts.append(f"-- rank {i} raised:\n{pickle.load(fh)}")
                else:
                    parts.append(f"-- rank {i} exited with code {procs[i].exitcode}\n")
            still = [i for i, p in enumerate(procs) if p.is_alive()]
            if still:
                parts.append(f"-- ranks {still} were still running and were killed\n")
            msg = f"spawn({name}, {world_size}): {len(failed)} rank(s) failed\n\n" + "\n".join(parts)
            raise mp.ProcessRaisedException(msg, failed[0], procs[failed[0]].pid)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for path in ctx.error_files:
            if path and os.path.exists(path):
                os.unlink(path)


def make_mesh(mesh_shape: dict[str, int], device: str = "cpu") -> DeviceMesh:
    """``init_device_mesh(device, sizes, mesh_dim_names=names)``, for use inside a spawned rank."""
    return init_device_mesh(device, tuple(mesh_shape.values()), mesh_dim_names=tuple(mesh_shape))


@contextlib.contextmanager
def simulated(mesh_shape: dict[str, int], device: str = "cpu") -> Iterator[DeviceMesh]:
    """Simulate ``prod(mesh_shape)`` ranks in this process (on ``device``); yields the DeviceMesh.

    Uses the fake process group and ``LocalTensorMode``: tensors made with
    :func:`rank_map` hold one value per rank and collectives are computed locally.
    Leaves the mode and destroys the process group on exit, also on error.
    """
    from torch.distributed._local_tensor import LocalIntNode, LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not hasattr(LocalIntNode, "str"):
        # torch 2.13's per-rank size (uneven shards: a different size on each simulated rank)
        # lacks SymNode.str, which some ops' checks call (rms_norm); a real rank has plain ints
        LocalIntNode.str = lambda self: repr(self)
    if dist.is_initialized():
        raise RuntimeError("simulated(): a process group is already initialised")
    world_size = math.prod(mesh_shape.values())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = make_mesh(mesh_shape, device)
        with LocalTensorMode(world_size):
            yield mesh
    finally:
        dist.destroy_process_group()


def rank_map(fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Under :func:`simulated`, a LocalTensor whose rank ``r`` value is ``fn(r)``;
    in a real rank, ``fn(dist.get_rank())``."""
    from torch.distributed._local_tensor import rank_map as _rank_map

    return _rank_map(fn)


def rank_value(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor of a LocalTensor, or ``t`` itself for a plain tensor."""
    local = getattr(t, "_local_tensors", None)
    if local is None:
        return t
    return local[rank]


def ranks_of(t: torch.Tensor) -> list[int]:
    """The ranks a LocalTensor holds values for (``[]`` for a plain tensor)."""
    local = getattr(t, "_local_tensors", None)
    return sorted(local) if local is not None else []


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Suspend simulated ranks for the block (no-op outside :func:`simulated`).

    Under ``LocalTensorMode`` even factory calls (``torch.randn``, ``torch.zeros``)
    make per-rank LocalTensors; compute expected values inside ``plain()``.
    """
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    lm = enabled_local_tensor_mode()
    if lm is None:
        yield
    else:
        with lm.disable():
            yield
