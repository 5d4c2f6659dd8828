"""Fixtures of the Slurm tests."""

from tests.slurm.cluster import slurm_cluster

__all__ = ["slurm_cluster"]
