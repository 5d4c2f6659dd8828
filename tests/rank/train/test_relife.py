"""A rank's process between two lives (a warm restart): after :func:`end_life` and :func:`release_life` the old
engine is gone (DeepSpeed's hooks held it), torch.distributed and DeepSpeed have no group left, and the next life
in the same process trains to the same numbers as the first did, bit for bit: nothing of the first life leaks
into it. Two real gloo ranks, real DeepSpeed ZeRO-2."""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

from tests.rank.train.gloo_ranks import two_gloo_ranks


def _life(rank: int, store: str) -> tuple[list[float], weakref.ref[object]]:
    import deepspeed
    import torch
    import torch.distributed as dist

    from hpc_train.rank.train.dscomm import init_deepspeed_comm

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    init_deepspeed_comm()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config)
    inputs = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(4, 16, generator=inputs)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, weakref.ref(engine)


def _two_lives(rank: int, store: str, out: str) -> None:
    import gc

    import deepspeed
    import deepspeed.utils.groups as groups
    import torch.distributed as dist

    from hpc_train.rank.runtime.heap import freeze_set_up
    from hpc_train.rank.train.relife import end_life, release_life

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")
    first, engine = _life(rank, store + "-1")
    freeze_set_up()  # as the trainer does after set-up: the old engine is frozen until release_life
    groups._get_data_parallel_group()  # DeepSpeed caches the group it is asked for
    end_life(engine())
    release_life()
    gone = engine() is None
    left = {"dist": dist.is_initialized(), "deepspeed": deepspeed.comm.is_initialized(),
            "world_group": groups._WORLD_GROUP is not None, "frozen": gc.get_freeze_count()}
    second, _ = _life(rank, store + "-2")
    Path(out).write_text(json.dumps({"first": first, "second": second, "gone": gone, "left": left}))
    dist.destroy_process_group()


def test_the_next_life_in_the_same_process_trains_as_the_first(tmp_path: Path) -> None:
    for result in two_gloo_ranks(_two_lives, tmp_path):
        assert result["gone"], "the first life's engine is still alive after release_life"
        assert result["left"] == {"dist": False, "deepspeed": False, "world_group": False, "frozen": 0}, result
        assert result["second"] == result["first"], result


def test_only_a_life_the_trainer_let_go_of_restarts_warm() -> None:
    """The trainer's failure path releases the life and marks its error only where the process may restart warm;
    a failure before the engine was whole (a peer's death inside deepspeed.initialize) never reaches it."""
    from types import SimpleNamespace

    from hpc_train.rank.train import trainer
    from hpc_train.rank.train.relife import life_released

    closed: list[str] = []
    parts = SimpleNamespace(stream=SimpleNamespace(close=lambda: closed.append("stream")),
                            checkpointer=SimpleNamespace(close=lambda: closed.append("checkpointer")),
                            engine=SimpleNamespace(destroy=lambda: closed.append("engine")))
    leaving, warm, building = (RuntimeError("Connection closed by peer") for _ in range(3))
    trainer._release(SimpleNamespace(warm=False), parts, leaving)  # type: ignore[arg-type]
    assert closed == [] and not life_released(leaving)  # on its way out: nothing delays its error record
    trainer._release(SimpleNamespace(warm=True), parts, warm)  # type: ignore[arg-type]
    assert closed == ["stream", "checkpointer", "engine"] and life_released(warm)
    assert not life_released(building)
