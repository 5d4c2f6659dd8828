"""Fixtures of the ops tests: the local Slurm cluster for the one test of the status view against a real job."""

from tests.slurm.cluster import slurm_cluster

__all__ = ["slurm_cluster"]
