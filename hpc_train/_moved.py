"""The import paths hpc_train had before its folders said where code runs (login/, rank/, checkpoint/, ...), kept
working: a user's model that imports ``hpc_train.train.pipeline_layers`` or
``hpc_train.distributed.tensor_parallel``, ``python -m hpc_train.train.prepare``, a test that patches an old path.
The old name is the new module itself (one module object, never a copy), with a DeprecationWarning that names the
new path. Installed first on ``sys.meta_path`` by ``import hpc_train``; a name outside this table costs one
dictionary walk."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

__all__ = ["MOVED", "install", "new_name"]

MOVED = {  # old module or package -> new; the longest match wins, and a package's modules follow it
    "hpc_train.agent_control": "hpc_train.rank.agent.link",
    "hpc_train.agent_setup": "hpc_train.rank.agent.setup",
    "hpc_train.agent_spares": "hpc_train.rank.agent.spares",
    "hpc_train.terminal": "hpc_train.common.terminal",
    "hpc_train.cli": "hpc_train.login.cli",
    "hpc_train.slurm": "hpc_train.login.slurm",
    "hpc_train.doctor": "hpc_train.login.doctor",
    "hpc_train.ops": "hpc_train.login.ops",
    "hpc_train.ops.scheduler": "hpc_train.backends.scheduler",
    **{f"hpc_train.ops.{name}": f"hpc_train.failures.{name}"
       for name in ("classify", "evidence", "policy", "records", "recovery", "signal_deaths")},
    "hpc_train.ckpt": "hpc_train.checkpoint",
    "hpc_train.ckpt.cli": "hpc_train.login.ckpt_cli",
    "hpc_train.distributed": "hpc_train.rank.distributed",
    "hpc_train.distributed.hostlist": "hpc_train.common.hostlist",
    "hpc_train.distributed.topology": "hpc_train.common.topology",
    "hpc_train.runtime": "hpc_train.rank.runtime",
    "hpc_train.runtime.checkpoints": "hpc_train.checkpoint.transaction",
    "hpc_train.runtime.rank_files": "hpc_train.checkpoint.rank_files",
    "hpc_train.runtime.dcp_files": "hpc_train.checkpoint.dcp_files",
    "hpc_train.train": "hpc_train.rank.train",
    "hpc_train.train.prepare": "hpc_train.login.prepare",
    "hpc_train.train.checkpointing": "hpc_train.checkpoint.deepspeed",
    "hpc_train.train.checkpoint_files": "hpc_train.checkpoint.deepspeed_files",
    "hpc_train.train.checkpointing_fsdp2": "hpc_train.checkpoint.fsdp2",
    **{f"hpc_train.train.{name}": f"hpc_train.config.{name}"
       for name in ("memory", "memory_fsdp2", "memory_rows", "precision_rule")},
    "hpc_train.program": "hpc_train.rank.program",
    "hpc_train.program.checkpoint": "hpc_train.checkpoint.program",
}


def new_name(name: str) -> str | None:
    """Where the module ``name`` lives now; None for a name that did not move."""
    head, tail = name, ""
    while head:
        if head in MOVED:
            return MOVED[head] + tail
        head, _, last = head.rpartition(".")
        tail = f".{last}{tail}"
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old name as the new module: the import system returns what ``sys.modules`` holds after
    :meth:`exec_module`, so both names are one module object."""

    def __init__(self, new: str, spec: importlib.machinery.ModuleSpec) -> None:
        self.new, self.spec = new, spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.new)

    def get_code(self, _name: str) -> CodeType | None:  # python -m OLD.NAME runs the new module's code
        get_code = getattr(self.spec.loader, "get_code", None)
        return get_code(self.new) if get_code else None


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith("hpc_train.") or (new := new_name(name)) is None:
            return None
        spec = importlib.util.find_spec(new)
        if spec is None:
            return None
        warnings.warn(f"{name} is now {new}; the old name will go in a later release", DeprecationWarning,
                      stacklevel=2)
        return importlib.util.spec_from_loader(name, _Alias(new, spec),
                                               is_package=spec.submodule_search_locations is not None)


def install() -> None:
    """Put the finder first, so that an old package's modules never load a second time under the old name."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
