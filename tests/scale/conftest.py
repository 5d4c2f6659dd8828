"""Fixtures of the scale lane: the local Slurm cluster, grown to many nodes by scripts/scale_lane.sh."""

from tests.slurm.cluster import slurm_cluster

__all__ = ["slurm_cluster"]
