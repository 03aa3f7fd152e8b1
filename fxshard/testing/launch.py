"""Running one function on every rank: gloo processes on this machine's CPU, or the
ranks ``torchrun`` started (NCCL on CUDA).

Example::

    def work(rank, world_size, steps):        # top level, so it pickles
        mesh = init_device_mesh(launch.device(), (world_size,), mesh_dim_names=("tp",))
        ...

    launch.run(work, 2, 5)      # under torchrun: in this process; else: 2 gloo processes
"""
from __future__ import annotations

import datetime
import multiprocessing.util
import os
import socket
import sys
from typing import Callable

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> str:
    """``"cuda"`` when the process group runs NCCL, else ``"cpu"``."""
    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_rank(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    """One spawned rank: join the gloo group on 127.0.0.1:``port``, run
    ``fn(rank, world_size, *args)``, leave together with the peers."""
    torch.set_num_threads(1)  # one core per rank: ranks must not fight over the CPUs
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=600))
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # no rank tears down while a peer still communicates
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: under load, c10d's background threads can abort a
    # process at exit ("terminate called without an active exception") after its work
    # is done; the result is already written.
    multiprocessing.util._exit_function()  # Python-level finalizers (locks, queues) still run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, world_size: int, *args, attempts: int = 3) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes on 127.0.0.1
    (``fn`` and ``args`` must pickle).  Retried on a new port when another job took the
    chosen one between choosing and binding it."""
    import torch.multiprocessing as mp

    for attempt in range(attempts):
        try:
            mp.spawn(run_rank, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
            return
        except mp.ProcessRaisedException as e:
            if attempt + 1 == attempts or not any(s in str(e) for s in ("EADDRINUSE", "Address already in use")):
                raise


def run(fn: Callable, world_size: int, *args) -> None:
    """Under ``torchrun``: ``fn(rank, world_size, *args)`` in this process on NCCL (one GPU
    per local rank) or gloo without CUDA.  Otherwise :func:`spawn` ``world_size`` gloo
    processes."""
    if not under_torchrun():
        spawn(fn, world_size, *args)
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        fn(dist.get_rank(), dist.get_world_size(), *args)
    finally:
        dist.destroy_process_group()
