"""Fixtures of the doctor tests: the real local Slurm cluster, for the few tests that submit a probe job."""

from tests.slurm.cluster import slurm_cluster

__all__ = ["slurm_cluster"]
