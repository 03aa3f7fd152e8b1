"""``fxshard.planner.fusion.FusedKernels``: the eager ops between two matmuls counted as the
kernels inductor fuses them into (one read of what a group takes from outside, one write of
what leaves it); the planner times a compiled program's blocks with these figures."""
from __future__ import annotations

import torch

from fxshard.planner.fusion import FusedKernels

T, H = 64, 32  # tokens, hidden: fp32, so a [T, H] tensor is 8 KiB
ACT = T * H * 4


def _norm(fused: FusedKernels, unit: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMSNorm as its eager ops, each fed to ``fused`` as the planner's counter feeds it."""
    sq = x.pow(2)
    fused.kernel(unit, [x], [sq])
    mean = sq.mean(-1, keepdim=True)
    fused.kernel(unit, [sq], [mean])
    r = (mean + 1e-6).rsqrt()
    fused.kernel(unit, [mean], [r])
    y = x * r
    fused.kernel(unit, [x, r], [y])
    out = y * w
    fused.kernel(unit, [y, w], [out])
    return out


def test_a_norm_before_a_matmul_is_one_kernel_reading_its_input_once():
    fused = FusedKernels()
    x, w, proj = torch.randn(T, H), torch.ones(H), torch.randn(H, H)
    y = _norm(fused, "block", x, w)
    fused.barrier("block", [y, proj])  # the matmul reads the norm's output: it leaves the kernel
    assert fused.totals() == {"block": (ACT + H * 4 + ACT, 1)}  # x and w read once, y written once


def test_a_result_read_after_a_matmul_is_written_and_read_again():
    fused = FusedKernels()
    x, w, proj = torch.randn(T, H), torch.ones(H), torch.randn(H, H)
    y = _norm(fused, "block", x, w)
    fused.barrier("block", [y, proj])
    h = torch.randn(T, H)  # the matmul's output
    z = x + h  # the residual: x read again, after the matmul, by a second kernel
    fused.kernel("block", [x, h], [z])
    nbytes, kernels = fused.totals()["block"]
    assert kernels == 2
    # kernel 1: x, w in, y out; kernel 2: x, h in, z out (z: nothing in the forward reads it, the unit's result)
    assert nbytes == (ACT + H * 4 + ACT) + (3 * ACT)


def test_a_fused_result_another_unit_reads_is_written_there_and_read_here():
    fused = FusedKernels()
    x = torch.randn(T, H)
    a = x * 2
    fused.kernel("block.0", [x], [a])
    b = a + 1
    fused.kernel("block.1", [a], [b])
    c = b.exp()
    fused.kernel("block.1", [b], [c])
    assert fused.totals() == {"block.0": (2 * ACT, 1), "block.1": (2 * ACT, 1)}


def test_ops_of_one_epoch_not_connected_are_kernels_of_their_own():
    fused = FusedKernels()
    x, y = torch.randn(T, H), torch.randn(T, H)
    a, b = x.exp(), y.exp()
    fused.kernel("block", [x], [a])
    fused.kernel("block", [y], [b])
    nbytes, kernels = fused.totals()["block"]
    assert (nbytes, kernels) == (4 * ACT, 2)


def test_a_view_reads_the_storage_its_maker_wrote():
    """A view (a transpose, a reshape) is no kernel: it shares its base's storage, so the op
    that reads it reads what the maker of the base wrote."""
    fused = FusedKernels()
    x = torch.randn(T, H)
    a = x.sin()
    fused.kernel("block", [x], [a])
    v = a.t()
    b = v.cos()
    fused.kernel("block", [v], [b])
    assert fused.totals() == {"block": (2 * ACT, 1)}  # sin and cos in one kernel: x in, b out
