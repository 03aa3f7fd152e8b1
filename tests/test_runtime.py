"""fxshard.runtime: every collective against the single-device math (docs/design.md §6).

A redistribute is the identity on the *global* value.  So for each op we pick a
global input X and a global upstream gradient G (different for every group of
ranks along the axis), lay them out per rank as the op's source/destination
layouts say, run the op and its backward, and check that every rank holds

* forward: X in the destination layout,
* backward: G in the source-gradient layout.

Layouts: ``R`` replicate (every rank holds the global value), ``S(d)`` shard
(rank i holds chunk i along d), ``P`` partial (ranks hold random summands of the
global value).  The same checks run under simulated ranks (LocalTensorMode) and
in real gloo processes.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch.testing import assert_close

from fxshard.runtime import collectives as runtime
from fxshard.plan.mesh import MeshSpec

try:
    from harness import make_mesh, plain, rank_map, rank_value, ranks_of, simulated, spawn
except ImportError:  # tests/ imported as a package
    from tests.harness import make_mesh, plain, rank_map, rank_value, ranks_of, simulated, spawn

R = ("R",)
P = ("P",)


def S(d):
    return ("S", d)


# name -> (op(x, axis), global shape, in layout, out layout, out-grad layout, in-grad layout)
CASES = {
    "all_reduce": (lambda x, a: runtime.all_reduce(x, a), (4, 6), P, R, R, R),
    "all_reduce_3d": (lambda x, a: runtime.all_reduce(x, a), (2, 4, 3), P, R, R, R),
    "reduce_scatter_d0": (lambda x, a: runtime.reduce_scatter(x, a, 0), (8, 3), P, S(0), S(0), R),
    "reduce_scatter_d1": (lambda x, a: runtime.reduce_scatter(x, a, 1), (3, 8, 2), P, S(1), S(1), R),
    "reduce_scatter_dneg1": (lambda x, a: runtime.reduce_scatter(x, a, -1), (3, 2, 4), P, S(-1), S(-1), R),
    "all_gather_d0": (lambda x, a: runtime.all_gather(x, a, 0), (8, 3), S(0), R, R, S(0)),
    "all_gather_d1": (lambda x, a: runtime.all_gather(x, a, 1), (3, 8, 2), S(1), R, R, S(1)),
    "all_gather_dneg1": (lambda x, a: runtime.all_gather(x, a, -1), (2, 3, 4), S(-1), R, R, S(-1)),
    "all_gather_partial_d0": (lambda x, a: runtime.all_gather(x, a, 0, grad="partial"), (4, 5), S(0), R, P, S(0)),
    "all_gather_partial_dneg2": (
        lambda x, a: runtime.all_gather(x, a, -2, grad="partial"), (3, 8, 2), S(-2), R, P, S(-2)),
    "shard_d0": (lambda x, a: runtime.shard(x, a, 0), (4, 3), R, S(0), S(0), R),
    "shard_d1": (lambda x, a: runtime.shard(x, a, 1), (3, 8, 2), R, S(1), S(1), R),
    "shard_dneg1": (lambda x, a: runtime.shard(x, a, -1), (2, 3, 4), R, S(-1), S(-1), R),
    "all_to_all_0_1": (lambda x, a: runtime.all_to_all(x, a, 0, 1), (8, 4), S(0), S(1), S(1), S(0)),
    "all_to_all_1_0": (lambda x, a: runtime.all_to_all(x, a, 1, 0), (4, 8), S(1), S(0), S(0), S(1)),
    "all_to_all_neg1_0": (lambda x, a: runtime.all_to_all(x, a, -1, 0), (4, 3, 8), S(-1), S(0), S(0), S(-1)),
    "all_to_all_2_1": (lambda x, a: runtime.all_to_all(x, a, 2, 1), (2, 4, 8, 3), S(2), S(1), S(1), S(2)),
    "all_to_all_1_neg1": (lambda x, a: runtime.all_to_all(x, a, 1, -1), (3, 4, 4), S(1), S(-1), S(-1), S(1)),
    "grad_sync": (lambda x, a: runtime.grad_sync(x, a), (4, 3), R, R, P, R),
    "grad_sync_3d": (lambda x, a: runtime.grad_sync(x, a), (2, 2, 3), R, R, P, R),
}


# ----------------------------------------------------------------------------- the math


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _randn(shape, *key) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(_seed(*key)), dtype=torch.float64)


def _coords(rank: int, mesh_shape: dict[str, int], axis: str):
    """(group key, index on ``axis``) of ``rank`` (init_device_mesh lays ranks out row-major)."""
    coords, r = {}, rank
    for name, size in reversed(list(mesh_shape.items())):
        coords[name] = r % size
        r //= size
    group = tuple((name, c) for name, c in coords.items() if name != axis)
    return group, coords[axis]


def _layout(t: torch.Tensor, layout, i: int, n: int, *key) -> torch.Tensor:
    """Rank ``i``'s local value of global ``t`` in ``layout`` (``key`` seeds the partial summands)."""
    if layout[0] == "R":
        return t.clone()
    if layout[0] == "S":
        return t.chunk(n, layout[1])[i].clone()
    parts = [_randn(t.shape, *key, j) for j in range(n - 1)]
    parts.append(t - sum(parts) if parts else t.clone())
    return parts[i]


def run_case(name: str, mesh_shape: dict[str, int], axis: str, ranks) -> None:
    """Run CASES[name] on ``axis`` of the bound mesh and check every rank in ``ranks``."""
    op, shape, lin, lout, lgout, lgin = CASES[name]
    n = mesh_shape[axis]

    def local(kind, layout, r):
        group, i = _coords(r, mesh_shape, axis)
        glob = _randn(shape, name, kind, group)
        return _layout(glob, layout, i, n, name, kind, "parts", group)

    x = rank_map(lambda r: local("X", lin, r)).requires_grad_()
    y = op(x, axis)
    gy = rank_map(lambda r: local("G", lgout, r))
    y.backward(gy)
    for r in ranks:
        with plain():
            want_y, want_gx = local("X", lout, r), local("G", lgin, r)
        got_y, got_gx = rank_value(y, r), rank_value(x.grad, r)
        assert_close(got_y, want_y, msg=lambda m: f"{name} on {axis} of {mesh_shape}, rank {r}, forward: {m}")
        assert_close(got_gx, want_gx, msg=lambda m: f"{name} on {axis} of {mesh_shape}, rank {r}, backward: {m}")
        assert got_y.is_contiguous(), f"{name}: output of rank {r} is not contiguous"


# ----------------------------------------------------------------------------- simulated ranks

SIM_MESHES = [
    ({"tp": 2}, "tp"),
    ({"tp": 4}, "tp"),
    ({"dp": 2, "tp": 2}, "tp"),
    ({"dp": 2, "tp": 2}, "dp"),
    ({"dp": 2, "tp": 1}, "tp"),  # size-1 axis: every op is a no-op
]


@pytest.fixture(autouse=True)
def _unbind():
    yield
    runtime.bind_mesh(None)


def _mesh_id(v):
    return "x".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else v


@pytest.mark.parametrize("mesh_shape,axis", SIM_MESHES, ids=_mesh_id)
def test_simulated(mesh_shape, axis):
    with simulated(mesh_shape) as mesh:
        runtime.bind_mesh(mesh)
        assert runtime.axis_size(axis) == mesh_shape[axis]
        for name in CASES:
            run_case(name, mesh_shape, axis, range(math.prod(mesh_shape.values())))


def test_simulated_bind_outside_mode():
    """Binding before LocalTensorMode is entered still yields per-rank indices at run time."""
    with simulated({"tp": 4}) as mesh:
        with plain():
            runtime.bind_mesh(mesh)
        run_case("shard_d1", {"tp": 4}, "tp", range(4))
        run_case("all_gather_d0", {"tp": 4}, "tp", range(4))


def test_axis_size_one_returns_input():
    with simulated({"dp": 2, "tp": 1}) as mesh:
        runtime.bind_mesh(mesh)
        x = rank_map(lambda r: torch.full((2, 3), float(r))).requires_grad_()
        for y in (runtime.all_reduce(x, "tp"), runtime.reduce_scatter(x, "tp", 1), runtime.all_gather(x, "tp", -1),
                  runtime.shard(x, "tp", 0), runtime.all_to_all(x, "tp", 0, 1), runtime.grad_sync(x, "tp")):
            assert y is x
        (x * 3).sum().backward()
        for r in ranks_of(x.grad):
            assert_close(rank_value(x.grad, r), torch.full((2, 3), 3.0))


def test_partial_vs_replicate_gather_backward_differ():
    """Same forward; grad="replicate" keeps the local chunk, grad="partial" sums the chunks over ranks."""
    with simulated({"tp": 2}) as mesh:
        runtime.bind_mesh(mesh)
        for mode, scale in (("replicate", 1.0), ("partial", 2.0)):
            x = rank_map(lambda r: torch.arange(3.0) + 10 * r).requires_grad_()
            y = runtime.all_gather(x, "tp", 0, grad=mode)
            y.backward(rank_map(lambda r: torch.arange(6.0)))
            for r in range(2):
                assert_close(rank_value(y, r), torch.tensor([0.0, 1, 2, 10, 11, 12]))
                assert_close(rank_value(x.grad, r), scale * torch.arange(3.0) + scale * 3 * r)


# ----------------------------------------------------------------------------- errors


def test_unbound_mesh():
    runtime.bind_mesh(None)
    with pytest.raises(RuntimeError, match="no device mesh is bound"):
        runtime.bound_mesh()
    with pytest.raises(RuntimeError, match=r"no device mesh is bound: fxshard.transform\(...\) binds one"):
        runtime.all_reduce(torch.ones(2), "tp")
    with pytest.raises(RuntimeError, match="no device mesh is bound"):
        runtime.axis_size("tp")


def test_meshspec_bound():
    spec = MeshSpec(("dp", "tp"), (2, 4))
    assert runtime.bind_mesh(spec) is None
    assert runtime.bound_mesh() is spec
    assert runtime.axis_size("tp") == 4 and runtime.axis_size("dp") == 2
    for call in (lambda: runtime.all_reduce(torch.ones(4), "tp"),
                 lambda: runtime.shard(torch.ones(4), "tp", 0),
                 lambda: runtime.grad_sync(torch.ones(4), "tp")):
        with pytest.raises(RuntimeError, match=r"'tp'.*MeshSpec.*DeviceMesh"):
            call()
    assert runtime.bind_mesh(None) is spec


def test_unknown_axis():
    runtime.bind_mesh(MeshSpec(("dp", "tp"), (2, 4)))
    with pytest.raises(ValueError, match=r"'ep' is not on the bound mesh.*\['dp', 'tp'\]"):
        runtime.all_reduce(torch.ones(4), "ep")
    with pytest.raises(ValueError, match=r"'ep'.*\['dp', 'tp'\]"):
        runtime.axis_size("ep")


@pytest.mark.parametrize("size,n", [(5, 2), (10, 4), (3, 4)], ids=["5 on 2", "10 on 4", "3 on 4: a rank holds none"])
def test_uneven_pieces_are_torch_chunk_simulated(size, n):
    """A dim the axis does not divide: shard keeps torch.chunk's piece, all_gather(size=)
    pads on the wire and cuts back, reduce_scatter sums and keeps the piece; backward too."""
    full = torch.randn(3, size, generator=torch.Generator().manual_seed(0))
    pieces = list(full.chunk(n, 1)) + [full[:, :0]] * (n - len(full.chunk(n, 1)))
    with simulated({"tp": n}) as mesh:
        runtime.bind_mesh(mesh)
        x = rank_map(lambda r: full.clone()).requires_grad_()
        local = runtime.shard(x, "tp", 1)
        back = runtime.all_gather(local, "tp", 1, size=size)
        partial = rank_map(lambda r: full * (r + 1))
        scattered = runtime.reduce_scatter(partial, "tp", -1)
        (back * 2).sum().backward()
        with plain():
            total = sum(range(1, n + 1))
            for r in range(n):
                torch.testing.assert_close(rank_value(local, r), pieces[r])
                torch.testing.assert_close(rank_value(back, r), full)
                torch.testing.assert_close(rank_value(scattered, r), pieces[r] * total)
                torch.testing.assert_close(rank_value(x.grad, r), torch.full_like(full, 2.0))


def test_bad_arguments():
    with simulated({"tp": 2}) as mesh:
        runtime.bind_mesh(mesh)
        x = rank_map(lambda r: torch.ones(3, 4))
        with pytest.raises(ValueError, match=r"dim 0 .* size 3.*not divisible by the size 2 of mesh axis 'tp'"):
            runtime.all_to_all(x, "tp", 1, 0)
        with pytest.raises(ValueError, match="same dim"):
            runtime.all_to_all(x, "tp", 1, -1)
        with pytest.raises(IndexError, match="out of range"):
            runtime.all_gather(x, "tp", 2)
        with pytest.raises(IndexError, match="out of range"):
            runtime.shard(x, "tp", -3)
        with pytest.raises(ValueError, match="grad must be"):
            runtime.all_gather(x, "tp", 0, grad="sum")
    with pytest.raises(TypeError):
        runtime.bind_mesh("tp")


# ----------------------------------------------------------------------------- fx


def test_fx_keeps_ops_as_leaves():
    def f(x):
        x = runtime.grad_sync(x, "tp")
        x = runtime.all_gather(x, "tp", -1, grad="partial")
        x = runtime.shard(x, "tp", 0)
        x = runtime.all_to_all(x, "tp", 0, 1)
        x = runtime.reduce_scatter(x, "tp", 1)
        return runtime.all_reduce(x, "tp")

    gm = torch.fx.symbolic_trace(f)
    gm2 = torch.fx.symbolic_trace(gm)  # re-tracing the generated code keeps them too
    for g in (gm, gm2):
        calls = [(n.target, n.args[1:], dict(n.kwargs)) for n in g.graph.nodes if n.op == "call_function"]
        assert calls == [
            (runtime.grad_sync, ("tp",), {}),
            (runtime.all_gather, ("tp", -1), {"grad": "partial"}),
            (runtime.shard, ("tp", 0), {}),
            (runtime.all_to_all, ("tp", 0, 1), {}),
            (runtime.reduce_scatter, ("tp", 1), {}),
            (runtime.all_reduce, ("tp",), {}),
        ]
    # and the generated code runs
    with simulated({"tp": 2}) as mesh:
        runtime.bind_mesh(mesh)
        x = rank_map(lambda r: torch.arange(16.0).view(4, 4) + r)
        y = gm2(x)
        # gather -> [A | A+1]; shard rows; all_to_all -> rank r holds column block r, i.e. A + r;
        # reduce_scatter -> columns 2r:2r+2 of 2A+1; all_reduce -> their sum over r.
        a = torch.arange(16.0).view(4, 4)
        want = (2 * a + 1)[:, 0:2] + (2 * a + 1)[:, 2:4]
        for r in range(2):
            assert_close(rank_value(y, r), want)


# ----------------------------------------------------------------------------- real processes

REAL_MESHES = [({"tp": 2}, "tp"), ({"dp": 2, "tp": 1}, "dp"), ({"dp": 2, "tp": 1}, "tp")]


def _compiled_chain(x, w):
    h = runtime.grad_sync(x, "tp") @ w
    h = runtime.all_gather(h, "tp", -1, grad="partial")
    h = runtime.shard(h, "tp", 0)
    h = runtime.all_to_all(h, "tp", 0, 1)
    h = runtime.reduce_scatter(h, "tp", 1)
    return runtime.all_reduce(h, "tp")


def _check_compile(rank: int) -> None:
    """torch.compile(fullgraph=True) traces the ops (no graph break) and matches eager, grads included."""
    x0, w0 = _randn((4, 4), "cx", rank), _randn((4, 4), "cw", rank)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = _compiled_chain(x, w)
    ref.square().sum().backward()
    xc, wc = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    out = torch.compile(_compiled_chain, backend="aot_eager", fullgraph=True)(xc, wc)
    out.square().sum().backward()
    assert_close(out, ref)
    assert_close(xc.grad, x.grad)
    assert_close(wc.grad, w.grad)


def _real_checks(rank: int, world_size: int) -> None:
    meshes = {}
    for mesh_shape, axis in REAL_MESHES:
        key = tuple(mesh_shape.items())
        if key not in meshes:
            meshes[key] = make_mesh(mesh_shape)
        runtime.bind_mesh(meshes[key])
        assert runtime.axis_size(axis) == mesh_shape[axis]
        for name in CASES:
            run_case(name, mesh_shape, axis, [rank])
    runtime.bind_mesh(meshes[(("tp", 2),)])
    _check_compile(rank)
    runtime.bind_mesh(None)


def test_real_gloo():
    spawn(_real_checks, 2)


# --------------------------------------------------------------------------- unequal pieces of a dynamic dim

def _sp_llama():
    from fxshard.testing.models import llama

    return llama(seed=0, n_heads=8, n_kv_heads=4)


def _sp_plan(mesh):
    from fxshard import Plan
    from fxshard.testing.models import llama_plan

    return Plan(mesh, llama_plan("tp", sequence_parallel=True))


def _sp_cases():
    """Sequence parallelism transformed on a sequence of 7 (tp=2: pieces 4 and 3) and run
    at 8 (4 and 4) and at 5 (3 and 2): the all-gathers' example size is not the run's."""
    from equivalence import Case, cross_entropy
    from fxshard.testing.models import tokens

    example = (tokens(2, 7, 128, seed=1),)
    return [Case(_sp_llama, _sp_plan, (tokens(3, s, 128, seed=2),), {"tp": 2}, loss_fn=cross_entropy,
                 targets=(tokens(3, s, 128, seed=3),), example_inputs=example, name=f"sp, example seq 7, run seq {s}")
            for s in (8, 5)]


def test_uneven_gather_takes_run_lengths_simulated():
    """all_gather(size=7) of pieces of another length (a dynamic dim run at 8 on tp=2:
    pieces 4 and 4, not 4 and 3) gathers all of them, and sequence parallelism
    transformed at an odd sequence length equals one device at other lengths."""
    from equivalence import check_simulated

    full = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(0))
    with simulated({"tp": 2}) as mesh:
        runtime.bind_mesh(mesh)
        local = rank_map(lambda r: full.chunk(2, 1)[r].clone())
        back = runtime.all_gather(local, "tp", 1, size=7)
        with plain():
            for r in range(2):
                assert_close(rank_value(back, r), full)
    runtime.bind_mesh(None)
    for case in _sp_cases():
        check_simulated(case.model_factory, case.plan_factory, case.inputs, case.mesh_shape, loss_fn=case.loss_fn,
                        targets=case.targets, example_inputs=case.example_inputs, name=case.name)


def test_uneven_gather_takes_run_lengths_real():
    """The same sequence-parallel cases on 2 gloo processes (the lengths exchanged by a
    real all-gather)."""
    from equivalence import check_real_cases

    check_real_cases(2, _sp_cases())
