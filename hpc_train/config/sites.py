"""Finding and loading a site config by name or path."""

from __future__ import annotations

import os
from pathlib import Path

from hpc_train.config.loader import build, load_toml
from hpc_train.config.screen import screen_site
from hpc_train.config.site import SiteConfig
from hpc_train.errors import ConfigError, did_you_mean
from hpc_train.resources import shipped_dir

__all__ = ["available_sites", "find_site", "load_site", "site_search_path"]


def site_search_path() -> list[Path]:
    """Folders searched for ``--site NAME``, first match wins: $HPC_TRAIN_SITE_PATH, the user's, shipped."""
    folders = [Path(p) for p in os.environ.get("HPC_TRAIN_SITE_PATH", "").split(":") if p]
    folders.append(Path(os.path.expanduser("~/.config/hpc_train/sites")))
    folders.append(shipped_dir("site_configs"))
    return folders


def available_sites() -> list[str]:
    """Names of every site on the search path."""
    names = {path.stem for folder in site_search_path() if folder.is_dir() for path in folder.glob("*.toml")}
    return sorted(names)


def find_site(name_or_path: str) -> Path:
    """A site argument is a path when it ends in .toml or holds a slash, else a name on the search path."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        return Path(name_or_path)
    for folder in site_search_path():
        candidate = folder / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    names = available_sites()
    hint = did_you_mean(name_or_path, names)
    raise ConfigError("--site", f'no site named "{name_or_path}"' + (f", {hint}" if hint else ""),
                      f"use one of {', '.join(names)} or a path to a site .toml file")


def load_site(name_or_path: str) -> SiteConfig:
    """Load and type-check a site; its name defaults to the file name."""
    path = find_site(name_or_path)
    data = load_toml(path, "site")
    data.setdefault("name", path.stem)
    try:
        screen_site(data)
        return build(SiteConfig, data, prefix="")
    except ConfigError as error:
        raise ConfigError(f"site {path}: {error.where}", error.problem, error.fix) from None
