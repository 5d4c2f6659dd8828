"""Every package of the source tree is listed in setup.cfg, so a wheel install has all of it (a missing one
only shows when a command imports it from the wheel)."""

from __future__ import annotations

import configparser

from tests.conftest import REPO


def test_every_package_is_in_the_wheel() -> None:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    found = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "hpc_train").rglob("__init__.py")}
    assert found - listed == set(), f"add to setup.cfg [options] packages: {sorted(found - listed)}"
