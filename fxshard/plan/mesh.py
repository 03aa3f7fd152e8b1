"""Device meshes as fxshard sees them: names, sizes and (optionally) a coordinate.

A real ``torch.distributed.device_mesh.DeviceMesh`` carries process groups; a
``MeshSpec`` carries only its shape, so plans can be written, validated, dumped and
transformed offline (no process group, no GPU).  Both answer the few questions
fxshard asks through :func:`mesh_shape` and :func:`mesh_coordinate`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class MeshSpec:
    """Shape of a device mesh without process groups.

    Example::

        >>> MeshSpec(("dp", "tp"), (2, 4))
        MeshSpec(names=('dp', 'tp'), sizes=(2, 4), coordinate=None)

    ``coordinate`` is the position of "this rank" on each axis; it decides which
    slice of each sharded parameter an offline transform keeps (default: all zeros).
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    coordinate: tuple[int, ...] | None = None

    def __init__(self, names: Sequence[str], sizes: Sequence[int], coordinate: Sequence[int] | None = None):
        names, sizes = tuple(names), tuple(int(s) for s in sizes)
        if len(names) != len(sizes):
            raise ValueError(f"MeshSpec: {len(names)} names {names} but {len(sizes)} sizes {sizes}")
        if len(set(names)) != len(names):
            raise ValueError(f"MeshSpec: axis names must be unique, got {names}")
        if any(s < 1 for s in sizes):
            raise ValueError(f"MeshSpec: sizes must be >= 1, got {sizes}")
        if coordinate is not None:
            coordinate = tuple(int(c) for c in coordinate)
            if len(coordinate) != len(sizes) or any(not 0 <= c < s for c, s in zip(coordinate, sizes)):
                raise ValueError(f"MeshSpec: coordinate {coordinate} is not inside the mesh {dict(zip(names, sizes))}")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "coordinate", coordinate)

    def __str__(self) -> str:
        return "MeshSpec(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes)) + ")"


Mesh = Union[DeviceMesh, MeshSpec]


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """``{axis_name: size}`` in mesh-dim order."""
    if isinstance(mesh, MeshSpec):
        return dict(zip(mesh.names, mesh.sizes))
    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError("fxshard needs a DeviceMesh with named dims: init_device_mesh(..., mesh_dim_names=('tp',))")
        return dict(zip(names, mesh.mesh.shape))
    raise TypeError(f"expected a DeviceMesh or fxshard.MeshSpec, got {type(mesh).__name__}")


def mesh_coordinate(mesh: Mesh):
    """This rank's coordinate per axis, ``{axis: index}``.

    Under ``LocalTensorMode`` the indices of a DeviceMesh are per-rank SymInts, so
    slicing with them yields per-rank local shards.
    """
    shape = mesh_shape(mesh)
    if isinstance(mesh, MeshSpec):
        coord = mesh.coordinate or (0,) * len(shape)
    else:
        coord = mesh.get_coordinate()
        if coord is None:
            raise RuntimeError("this rank is not part of the mesh")
    return dict(zip(shape, coord))
