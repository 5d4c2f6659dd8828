"""The node's fabric as sysfs shows it: what NCCL will find, read on a login or compute node without torch."""

from hpc_train.fabric.sysfs import Fabric, Gid, Gpu, NetInterface, Port, RdmaDevice, read_fabric

__all__ = ["Fabric", "Gid", "Gpu", "NetInterface", "Port", "RdmaDevice", "read_fabric"]
