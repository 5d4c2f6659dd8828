"""Every generator a rank draws from comes back as it was saved, from a file torch loads with weights_only."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_train.rank.runtime import random_state


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()  # noqa: S311


def test_python_numpy_and_torch_come_back_through_a_weights_only_file(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(random_state.capture(torch.device("cpu")), tmp_path / "rank-0.pt")
    expected = _draws()
    _draws()
    random_state.restore(torch.load(tmp_path / "rank-0.pt", weights_only=True), torch.device("cpu"))
    assert _draws() == expected


def test_a_gpu_rank_saves_and_restores_the_generator_of_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    saved: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.tensor([7, int(device.index)]))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: saved.update(state=state, device=device))
    device = torch.device("cuda", 1)
    state = random_state.capture(device)
    assert state["cuda"].tolist() == [7, 1]
    random_state.restore(state, device)
    assert saved["device"] == device and saved["state"].tolist() == [7, 1]
    assert "cuda" not in random_state.capture(torch.device("cpu"))
