"""The committed key references are exactly what the schema generates: docs list every key, always."""

from __future__ import annotations

import pytest

from hpc_train.config.job import JobConfig
from hpc_train.config.reference import reference_markdown
from hpc_train.config.site import SiteConfig
from tests.conftest import REPO


@pytest.mark.parametrize(("root", "doc", "which"), [(JobConfig, "configuration-reference.md", "job"),
                                                    (SiteConfig, "site-reference.md", "site")])
def test_reference_is_current(root: type, doc: str, which: str) -> None:
    committed = (REPO / "docs" / doc).read_text(encoding="utf-8")
    assert committed == reference_markdown(root), (
        f"docs/{doc} is stale: python -m hpc_train.config.reference {which} > docs/{doc}")
