"""Fixtures of the bench tests: the local Slurm cluster, for the 2-node job."""

from tests.slurm.cluster import slurm_cluster

__all__ = ["slurm_cluster"]
