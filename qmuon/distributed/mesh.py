"""The device mesh of sharded QMuon parameters: which mesh dim splits the rows, which replicates.

FSDP2 ``fully_shard`` on a 1-D mesh gives ``(Shard(0),)``; HSDP (``fully_shard`` on a 2-D
``(replicate, shard)`` mesh) gives ``(Replicate(), Shard(0))``: the rows are split over the shard
dim and every replica (a slice of the replicate dim) holds the same rows, with the same gradients
(FSDP reduce-scatters inside a replica and all-reduces across replicas). :class:`ShardMesh` names
the two process groups the sharded step uses: the all-to-all of the whole-matrix Newton-Schulz runs
over the shard dim only, and the results of the matrices a replica orthogonalized are shared over
the replicate dim (:mod:`.orthogonalize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..quant.layout import check_sharded_param, shard_mesh_dim

__all__: list[str] = []


@dataclass(frozen=True)
class ShardMesh:
    """Process groups and ranks of a ``Shard(0)`` (1-D) or HSDP (``(replicate, shard)``) mesh.

    ``shard_*``: the dim that splits rows (the all-to-all group); ``replica`` / ``replicas``: this
    rank's index along the replicate dim and its size (1 on a 1-D mesh, no group)."""

    mesh: Any
    shard_dim: int
    shard_group: Any
    shard_size: int
    shard_rank: int
    replicate_group: Any
    replicas: int
    replica: int

    @classmethod
    def of(cls, p: Any, where: str = "parameter") -> "ShardMesh":
        """The mesh of the DTensor parameter ``p`` (checked: one ``Shard(0)`` dim, at most one
        ``Replicate()`` dim)."""
        check_sharded_param(p, where)
        mesh = p.device_mesh
        if mesh.ndim > 2:
            raise NotImplementedError(
                f"QMuon: {where} is on a {mesh.ndim}-D mesh with placements {tuple(p.placements)}; sharded QMuon "
                "supports a 1-D mesh (Shard(0),) or a 2-D (replicate, shard) HSDP mesh (Replicate(), Shard(0)). "
                "Shard Muon parameters over at most two mesh dims (fully_shard with mesh[('replicate', 'shard')])")
        dim = shard_mesh_dim(p)
        rep_dim = 1 - dim if mesh.ndim == 2 else None
        return cls(
            mesh=mesh, shard_dim=dim, shard_group=mesh.get_group(dim), shard_size=mesh.size(dim),
            shard_rank=mesh.get_local_rank(dim),
            replicate_group=mesh.get_group(rep_dim) if rep_dim is not None else None,
            replicas=mesh.size(rep_dim) if rep_dim is not None else 1,
            replica=mesh.get_local_rank(rep_dim) if rep_dim is not None else 0,
        )
