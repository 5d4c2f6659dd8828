"""The DeepSpeed trainer's asynchronous save (hpc_train.checkpoint.deepspeed): the parameters and the optimizer's
state (ZeRO's fp32 partition, Adam's moments) are copied by the writer thread after the save call returns, and
the optimizer's next step waits for those copies (a step pre-hook), so the checkpoint holds the state at the save.
Real DeepSpeed (ZeRO-2 on CPU, one rank of gloo) in a process of its own, with the writer's copies slowed so that a
step that did not wait would change what they copy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow

WORKER = r"""
import sys, time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hpc_train.checkpoint import rank_files
from hpc_train.checkpoint.deepspeed import Checkpointer
from hpc_train.checkpoint.deepspeed_files import load_safely, stable_until_step
from hpc_train.checkpoint.names import DEEPSPEED_TAG
from hpc_train.common.topology import Topology
from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build, load_toml
from hpc_train.config.overrides import apply_overrides
from hpc_train.rank.distributed.mesh import ModelParallelUnit, ParallelGroups
from hpc_train.rank.train.engine import build_engine
from hpc_train.rank.train.model import GPT, GPTConfig

run_dir, repo = Path(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo")
data = apply_overrides(load_toml(repo / "examples" / "tiny_gpt.toml", "config"),
                       ["train.precision=fp32", "train.seq_len=16", "train.micro_batch=2", "train.warmup_steps=1",
                        "checkpoint.async_save=true"], JobConfig)
config = build(JobConfig, data)
groups = ParallelGroups(Topology.build(1, tp=1, pp=1, cp=1, order="tp-cp-dp-pp"), "cpu")
model = GPT(GPTConfig(64, 16, 1, 2, 32), groups.group("tp"), seed=1)
engine = build_engine(model, config, 1, ModelParallelUnit(groups), run_dir, 0)
inputs = torch.randint(0, 64, (2, 16))


def step():
    loss = engine(inputs, inputs)
    engine.backward(loss)
    engine.step()


step()
tensors, optimizer = stable_until_step(engine)
stable = {rank_files.storage_of(t) for t in tensors}
buffers = {rank_files.storage_of(b) for b in engine.module.buffers() if b.numel()}
assert optimizer is engine.optimizer.optimizer and stable and not stable & buffers, (optimizer, stable, buffers)
at_save = {name: tensor.clone() for name, tensor in engine.module.state_dict().items()}
fp32_at_save = [t.clone() for t in engine.optimizer.single_partition_of_fp32_groups]
adam_at_save = {k: v.clone() for k, v in engine.optimizer.optimizer.state[engine.optimizer.optimizer.param_groups[0]
                                                                               ["params"][0]].items()}
copy_all = rank_files._copy_all
rank_files._copy_all = lambda later, copied: (time.sleep(2.0), copy_all(later, copied))  # a slow copy
layout = SimpleNamespace(world=1, tensor=1, pipeline=1, data=1, context=1)
checkpoints = Checkpointer(run_dir, config, layout, "test")
checkpoints.save(engine, 1, {"epoch": 0, "offset": 0})
step()  # its optimizer step must wait for the copies
waited = checkpoints.files.settle_wait_s
checkpoints.finish()
assert any(not torch.equal(at_save[n], t) for n, t in engine.module.state_dict().items())  # the step changed them
folder = run_dir / "checkpoints" / "step-00000001" / DEEPSPEED_TAG
saved = load_safely((folder / "mp_rank_00_model_states.pt").read_bytes())["module"]
different = [name for name, tensor in at_save.items() if not torch.equal(saved[name], tensor)]
assert not different, different
optimizer_file = load_safely((folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes())
state = optimizer_file["optimizer_state_dict"]
assert all(torch.equal(a, b) for a, b in zip(state["single_partition_of_fp32_groups"], fp32_at_save, strict=True))
adam_saved = state["base_optimizer_state"]["state"][0]
assert all(torch.equal(adam_saved[k], v) for k, v in adam_at_save.items()), sorted(adam_at_save)
assert not torch.equal(engine.optimizer.single_partition_of_fp32_groups[0], fp32_at_save[0])
print(f"OK waited {waited:.2f}")
checkpoints.close()
dist.destroy_process_group()
"""


def test_the_step_after_an_async_save_waits_for_its_copies(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", WORKER, str(run_dir), str(REPO)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    waited = float(result.stdout.split("OK waited ")[1].split()[0])
    assert waited > 0.5  # the step waited for the slowed copies rather than changing what they copy
