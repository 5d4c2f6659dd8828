"""Checkpoint save and load through the real Checkpointer and DeepSpeed, against raw disk I/O of the same bytes.

    .venv/bin/python benchmarks/checkpoint.py [--ranks 2] [--layers 4] [--hidden 512] [--saves 3] [--json]
    .venv/bin/python benchmarks/checkpoint.py --ranks 4 --layers 5 --hidden 1024     # a 1 GB checkpoint
    .venv/bin/python benchmarks/checkpoint.py --smoke                                # tiny, once: CI runs it
    .venv/bin/python benchmarks/checkpoint.py --engine fsdp2                         # FSDP2's DCP shards
    .venv/bin/python benchmarks/checkpoint.py --engine fsdp2 --profile               # where a save's time goes

``--ranks`` ranks on this machine (gloo), a GPT built as the trainer builds it (ZeRO-2, torch AdamW, the
model-parallel unit) and ``hpc_train.checkpoint.deepspeed.Checkpointer``; with ``--engine fsdp2`` the FSDP2 engine and
``hpc_train.checkpoint.fsdp2.Fsdp2Checkpoints`` (the shards through ``torch.distributed.checkpoint`` inside
the same transaction; a DCP file ``__R_N.distcp`` counts as rank R's, ``.metadata`` as rank 0's). After one
untimed save:

* save: each synchronous save is timed whole (every rank's files, hashed while written and fsynced, the commit:
  manifest, rename, ``latest``), between two raw writes of the same bytes: every rank writes files of the sizes it
  wrote in the save (rank 0 also the small files DeepSpeed writes by itself), each fsynced, then the folder, all
  ranks at once; the baseline is the mean of the two, so a disk that drifts hits both sides;
* load: the page cache is dropped (as root; otherwise the figures are warm-cache ones and say so), then every rank
  resumes from the newest checkpoint (rank 0's size check, every rank's reads, deserialization into the engine),
  between two cold raw reads by every rank of exactly the files its load read;
* async: saves with ``checkpoint.async_save``; the stall is the time the training loop waits for the save: the
  save call (the staging copies it makes) and the next optimizer step's wait for the copies it left to the writer
  thread, on the slowest rank, against a synchronous save; beside it, how much longer than a plain step the steps
  that run while the files are written take (the writer threads' CPU: on a machine whose every core trains, it
  shows).

``--profile``: rank 0 runs one more synchronous save and one more load under ``cProfile`` (after the timed ones,
so the figures above are not profiled) and the report lists, for each, the seconds spent in each part of the
path: the engine's state dict, DCP's planning (with its collectives), the writes or reads of the bytes, hashing,
serialization, putting the state into the engine, and the transaction's own work (folder, manifest, fsync,
rename). The parts are cumulative times of named functions, so a part called inside another is counted in
both. The profiles are kept as ``save.prof`` and ``load.prof`` in ``--dir``; without it they go with the temporary
run folder.

The last line with ``--json`` is one JSON object: ``save_ratio`` (raw seconds over save seconds: speed relative to
raw), ``load_ratio`` (load seconds over raw seconds), ``async_stall_ratio`` (async stall over a synchronous save),
with the raw MB/s beside them. Targets: save >= 0.8, load <= 1.3, stall <= 0.1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hpc_train.bench.local_ranks import free_port
from hpc_train.bench.machine import machine, spread

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 2
CHUNK = 8 << 20


# ----- the ranks -----

def _job_config(args: dict[str, Any], async_save: bool) -> Any:
    """The quick-start job with this benchmark's sizes, resolved as ``hpc_train.submit`` resolves it."""
    from hpc_train.config.job import JobConfig
    from hpc_train.config.loader import build, load_toml
    from hpc_train.config.overrides import apply_overrides

    overrides = [f"train.precision={args['precision']}", f"train.seq_len={args['seq_len']}",
                 f"train.micro_batch={args['micro_batch']}", "train.warmup_steps=1", "checkpoint.keep=2",
                 f"checkpoint.async_save={'true' if async_save else 'false'}", f"checkpoint.verify={args['verify']}"]
    if args["engine"] == "fsdp2":
        overrides.append("train.engine=fsdp2")
    data = apply_overrides(load_toml(REPO / "examples" / "tiny_gpt.toml", "config"), overrides, JobConfig)
    return build(JobConfig, data)


def _timed_together(action: Callable[[], Any]) -> float:
    """Seconds from a common barrier until the last rank finished ``action``."""
    import torch.distributed as dist

    from hpc_train.rank.distributed.collectives import all_reduce_values

    dist.barrier()
    start = time.perf_counter()
    action()
    return float(all_reduce_values([time.perf_counter() - start], op="max")[0])


def _drop_caches() -> bool:
    """Empty the page cache (root only), so that reads come from the disk; every rank calls it."""
    import torch.distributed as dist

    dropped = False
    if dist.get_rank() == 0 and os.geteuid() == 0:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            dropped = True
        except OSError:
            pass
    dist.barrier()
    return dropped


def _raw_write(folder: Path, sizes: list[int]) -> None:
    """Files of ``sizes`` written sequentially, each fsynced, then the folder fsynced: the save baseline."""
    block = memoryview(os.urandom(CHUNK))  # slices without copying
    folder.mkdir()
    for index, size in enumerate(sizes):
        with open(folder / f"file-{index}", "wb") as handle:
            for offset in range(0, size, CHUNK):
                handle.write(block[:min(CHUNK, size - offset)])
            handle.flush()
            os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _raw_read(paths: list[str]) -> None:
    """Every file read whole into memory in 8 MiB reads: the load baseline."""
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            data = bytearray(os.fstat(handle.fileno()).st_size)
            view, done = memoryview(data), 0
            while done < len(data):
                done += handle.readinto(view[done:done + CHUNK]) or len(data)


def _hash_alone(paths: list[str]) -> Callable[[], None]:
    """sha256 of every file (read into memory outside the clock) with hashlib alone: what checkpoint.verify =
    "sha256" adds to a load, the library's own figure."""
    contents = [Path(path).read_bytes() for path in paths]

    def hash_all() -> None:
        for content in contents:
            hashlib.sha256(content).digest()

    return hash_all


def _raw_baseline(run_dir: Path, sizes: list[int], tag: str) -> float:
    """Every rank writes its raw files at once; the folders are removed outside the clock."""
    import torch.distributed as dist

    folder = run_dir / f"raw-{tag}-{dist.get_rank()}"
    seconds = _timed_together(lambda: _raw_write(folder, sizes))
    shutil.rmtree(folder)
    return seconds


def _train_step(engine: Any, stream: Any) -> float:
    """One optimizer step as the trainer takes it (grad_accum 1); seconds."""
    start = time.perf_counter()
    inputs, targets = next(stream)
    loss = engine(inputs, targets)
    engine.backward(loss)
    engine.step()
    float(loss)
    return time.perf_counter() - start


def _dcp_owner(path: str) -> int | None:
    """The rank that wrote a DCP file (``dcp/__R_N.distcp``: R), or None for anything else."""
    name = Path(path).name
    if Path(path).parent.name == "dcp" and name.startswith("__") and name.endswith(".distcp"):
        return int(name[2:].split("_")[0])
    return None


def _my_sizes(checkpointer: Any, step: int) -> list[int]:
    """The sizes of the files this rank wrote in the last save (its own DCP shards too; rank 0 also the files
    nobody wrote through the writer, DCP's ``.metadata`` among them), from the committed manifest."""
    import torch.distributed as dist

    from hpc_train.checkpoint import Manifest
    from hpc_train.rank.distributed.collectives import all_gather_objects, broadcast_object

    rank = dist.get_rank()
    manifest = None
    if checkpointer.manager:
        manifest = Manifest.from_json((checkpointer.manager.root / f"step-{step:08d}" / "manifest.json").read_text())
    manifest = broadcast_object(manifest)
    mine = {entry.path for entry in checkpointer.files.entries}
    mine |= {entry.path for entry in manifest.files if _dcp_owner(entry.path) == rank}
    everyone = set().union(*all_gather_objects(sorted(mine)))
    return [entry.size for entry in manifest.files
            if entry.path in mine or (rank == 0 and entry.path not in everyone)]


def _dcp_reads(checkpointer: Any, rank: int) -> list[str]:
    """The DCP files a rank reads when it loads at the world size it saved at: its own shards and the metadata."""
    found = checkpointer.latest()
    if found is None or not (found / "dcp").is_dir():
        return []
    return [str(path) for path in sorted((found / "dcp").iterdir())
            if path.name == ".metadata" or _dcp_owner(f"dcp/{path.name}") == rank]


class _ReadLog:
    """The files one rank's load reads, for a raw read of exactly those."""

    def __init__(self, files: Any) -> None:
        self.paths: list[str] = []
        original = files.load

        def load(path: Path, map_location: Any = None) -> Any:
            self.paths.append(str(path))
            return original(path, map_location)

        files.load = load


def worker(args: dict[str, Any]) -> None:
    """One rank: build the engine as the trainer does, then saves, loads and async saves; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from hpc_train.common.topology import Topology
    from hpc_train.rank.distributed.collectives import all_reduce_values
    from hpc_train.rank.distributed.mesh import ModelParallelUnit, ParallelGroups
    from hpc_train.rank.train.data import ResumableSampler, SyntheticTokens, batch
    from hpc_train.rank.train.model import GPT, GPTConfig, count_parameters

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world, run_dir = dist.get_rank(), dist.get_world_size(), Path(args["run_dir"])
    config = _job_config(args, async_save=False)
    groups = ParallelGroups(Topology.build(world, tp=1, pp=1, cp=1, order="tp-cp-dp-pp"), "cpu")
    shape = GPTConfig(256, args["seq_len"], args["layers"], args["heads"], args["hidden"])
    model = GPT(shape, groups.group("tp"), seed=1234)
    layout = SimpleNamespace(world=world, tensor=1, pipeline=1, data=world, context=1)
    if args["engine"] == "fsdp2":
        from hpc_train.checkpoint.fsdp2 import Fsdp2Checkpoints as Checkpoints
        from hpc_train.rank.train.engine_fsdp2 import Fsdp2Engine

        engine = Fsdp2Engine(model, SimpleNamespace(config=config), groups, torch.device("cpu"))
    else:
        from hpc_train.checkpoint.deepspeed import Checkpointer as Checkpoints
        from hpc_train.rank.train.engine import build_engine

        engine = build_engine(model, config, world, ModelParallelUnit(groups), run_dir, int(os.environ["LOCAL_RANK"]))
    sync = Checkpoints(run_dir, config, layout, "benchmark")
    source = SyntheticTokens(256, 1234)
    sampler = ResumableSampler(source.num_samples(args["seq_len"]), rank, world, args["micro_batch"], 1234)
    stream = iter(lambda: batch(source, sampler.next_indices(), args["seq_len"]), None)
    plain = [_train_step(engine, stream) for _ in range(WARMUP_STEPS)]
    step = WARMUP_STEPS
    sync.save(engine, step, sampler.state_dict())  # untimed: first-save costs, and the file sizes
    sync.finish()
    sizes = _my_sizes(sync, step)
    saves: list[dict[str, Any]] = []
    for index in range(args["saves"]):
        plain.append(_train_step(engine, stream))
        step += 1
        before = _raw_baseline(run_dir, sizes, f"save{index}a")
        seconds = _timed_together(lambda s=step: (sync.save(engine, s, sampler.state_dict()), sync.finish()))
        after = _raw_baseline(run_dir, sizes, f"save{index}b")
        saves.append({"save_s": seconds, "raw_s": (before + after) / 2})
    reads = _ReadLog(sync.files)
    loads: list[dict[str, Any]] = []
    cold = True
    for _ in range(args["saves"]):
        reads.paths.clear()
        cold &= _drop_caches()
        load_s = _timed_together(lambda: sync.resume(engine))
        mine = list(reads.paths) + (_dcp_reads(sync, rank) if args["engine"] == "fsdp2" else [])
        cold &= _drop_caches()
        raw_a = _timed_together(lambda m=mine: _raw_read(m))
        cold &= _drop_caches()
        raw_b = _timed_together(lambda m=mine: _raw_read(m))
        hash_s = _timed_together(_hash_alone(mine)) if args["verify"] == "sha256" else 0.0
        loads.append({"load_s": load_s, "raw_s": (raw_a + raw_b) / 2, "hash_s": hash_s,
                      "bytes": sum(os.path.getsize(p) for p in mine)})
    asynchronous = Checkpoints(run_dir, _job_config(args, async_save=True), layout, "benchmark")
    stalls: list[dict[str, Any]] = []
    for _ in range(args["saves"]):
        plain += [_train_step(engine, stream) for _ in range(2)]
        step += 3
        settled = asynchronous.files.settle_wait_s
        start = time.perf_counter()
        asynchronous.save(engine, step, sampler.state_dict())
        call_s = time.perf_counter() - start
        during = [_train_step(engine, stream) for _ in range(args["steps_during"])]
        step += args["steps_during"]
        waited = asynchronous.files.settle_wait_s - settled  # the next optimizer step's wait for the copies
        stall_s, waited = all_reduce_values([call_s + waited, waited], op="max")  # the slowest rank holds all
        durable_s = _timed_together(asynchronous.finish)
        stalls.append({"call_s": stall_s, "settle_s": waited, "during": during, "finish_s": durable_s})
    profiles = _profiled(sync, engine, stream, sampler, step + 1, rank) if args["profile"] else {}
    if rank == 0:
        newest = sync.manager.list()[-1].manifest.files
        print(json.dumps({"parameters": count_parameters(shape), "world": world, "sizes": sizes,
                          "bytes": sum(e.size for e in newest), "files": len(newest), "saves": saves, "loads": loads,
                          "cold": cold, "stalls": stalls, "plain": plain, "profiles": profiles}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# Where a save's and a load's time goes: (part, the functions whose cumulative seconds it sums), each named
# "file:function" by the end of its file's path ("~" for Python's built-ins), so that a torch release that moves a
# helper empties a row instead of breaking the report. Rows indented under another are inside it.
PARTS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "save": [
        ("engine state dict (get_state_dict)", ("state_dict.py:get_state_dict",)),
        ("DCP planning (local and global plans, collectives)", ("state_dict_saver.py:local_step",
                                                                "state_dict_saver.py:global_step")),
        ("DCP write_data (serialize and write the shards)", ("state_dict_saver.py:write_data",)),
        ("  torch.save of each tensor (one per item)", ("serialization.py:save",)),
        ("    the writes (os.write)", ("~:<built-in method posix.write>",)),
        ("    sha256 while written", ("~:<method 'update' of '_hashlib.HASH' objects>",)),
        ("DCP finish_checkpoint (metadata)", ("state_dict_saver.py:finish_checkpoint",)),
        ("the rank's own small file", ("rank_files.py:save",)),
        ("transaction: wait for every rank, commit", ("checkpoints.py:finish",)),
    ],
    "load": [
        ("engine state dict (get_state_dict)", ("state_dict.py:get_state_dict",)),
        ("DCP planning (local and global plans, collectives)", ("state_dict_loader.py:local_step",
                                                                "state_dict_loader.py:global_step")),
        ("DCP read_data (read, check and load the shards)", ("state_dict_loader.py:read_data",)),
        ("  reads into the tensors, sha256 behind them", ("verified_read.py:readinto",)),
        ("  sha256 of what was read out of order", ("verified_read.py:_hash_from_file",)),
        ("  torch.load of each tensor (one per item)", ("serialization.py:load",)),
        ("  copy into the model's tensors", ("~:<method 'copy_' of 'torch._C.TensorBase' objects>",)),
        ("put the state into the engine (set_state_dict)", ("state_dict.py:set_state_dict",)),
        ("the rank's own small file", ("rank_files.py:load",)),
    ],
}


def _part_seconds(stats: dict[Any, Any], names: tuple[str, ...]) -> float:
    total = 0.0
    for (file, _line, function), entry in stats.items():
        for name in names:
            where, _, what = name.partition(":")
            if function == what and (file == where if where == "~" else file.endswith(where)):
                total += entry[3]  # cumulative seconds
    return total


def _profiled(sync: Any, engine: Any, stream: Any, sampler: Any, step: int, rank: int) -> dict[str, Any]:
    """One more synchronous save and load, rank 0 under cProfile: {kind: [[part, seconds], ...], the total}."""
    import cProfile
    import pstats

    _train_step(engine, stream)
    found: dict[str, Any] = {}
    for kind, action in (("save", lambda: (sync.save(engine, step, sampler.state_dict()), sync.finish())),
                         ("load", lambda: sync.resume(engine))):
        profile = cProfile.Profile() if rank == 0 else None
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        _timed_together(action)
        if profile is None:
            continue
        profile.disable()
        total = time.perf_counter() - start
        path = Path(os.environ.get("HPC_TRAIN_BENCH_PROFILE_DIR", ".")) / f"{kind}.prof"
        profile.dump_stats(str(path))
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        rows = [[part, _part_seconds(stats, names)] for part, names in PARTS[kind]]
        found[kind] = {"total_s": total, "parts": rows, "file": str(path)}
    return found


# ----- the login side -----

def run_ranks(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Start ``args.ranks`` ranks of this file in worker mode; rank 0's JSON line."""
    spec = {"run_dir": str(run_dir), "saves": args.saves, "layers": args.layers, "heads": args.heads,
            "hidden": args.hidden, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "precision": args.precision, "verify": args.verify, "steps_during": args.steps_during,
            "engine": args.engine, "profile": args.profile}
    port = free_port()
    procs = []
    for rank in range(args.ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(rank),
               "LOCAL_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
               "HPC_TRAIN_BENCH_PROFILE_DIR": str(args.dir.resolve() if args.dir else run_dir)}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                                      cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=1800) for proc in procs]
    results = [line for line in outputs[0][0].splitlines() if line.startswith("{")]
    for rank, (proc, (_out, err)) in enumerate(zip(procs, outputs, strict=True)):
        if proc.returncode and not results:
            sys.exit(f"rank {rank} failed ({proc.returncode}):\n{err[-3000:]}")
        if proc.returncode:  # after the measurements: say so, keep them
            print(f"note: rank {rank} exited with {proc.returncode} after its work: {err.strip()[-200:]}",
                  file=sys.stderr)
    return json.loads(results[-1])


def _median(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> float:
    return statistics.median(key(row) for row in rows)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the targets are about, from the ranks' raw timings (medians of per-repetition ratios)."""
    total, saves, loads, stalls = result["bytes"], result["saves"], result["loads"], result["stalls"]
    plain = statistics.median(result["plain"])
    sync_save = _median(saves, lambda s: s["save_s"])
    slowed = _median(stalls, lambda s: sum(max(0.0, t - plain) for t in s["during"]))
    return {
        "ranks": result["world"], "parameters": result["parameters"], "checkpoint_mb": total / 1e6,
        "files": result["files"],
        "save_s": sync_save, "save_raw_s": _median(saves, lambda s: s["raw_s"]),
        "save_ratio": _median(saves, lambda s: s["raw_s"] / s["save_s"]),
        "save_mb_s": total / 1e6 / sync_save, "raw_write_mb_s": total / 1e6 / _median(saves, lambda s: s["raw_s"]),
        "load_s": _median(loads, lambda s: s["load_s"]), "load_raw_s": _median(loads, lambda s: s["raw_s"]),
        "load_ratio": _median(loads, lambda s: s["load_s"] / s["raw_s"]),
        "raw_read_mb_s": _median(loads, lambda s: s["bytes"] / 1e6 / s["raw_s"]), "load_cold_cache": result["cold"],
        "load_hash_s": _median(loads, lambda s: s.get("hash_s", 0.0)),
        "plain_step_s": plain, "async_stall_s": _median(stalls, lambda s: s["call_s"]),
        "async_stall_ratio": _median(stalls, lambda s: s["call_s"]) / sync_save,
        "async_slowed_steps_s": slowed, "async_slowed_ratio": slowed / sync_save,
        "async_durable_after_s": _median(stalls, lambda s: s["finish_s"]), "profiles": result.get("profiles", {}),
        "async_settle_s": _median(stalls, lambda s: s.get("settle_s", 0.0)),
        "spreads": {  # each ratio over the repetitions: min, median, max
            "save_ratio": spread([s["raw_s"] / s["save_s"] for s in saves]).text(),
            "load_ratio": spread([s["load_s"] / s["raw_s"] for s in loads]).text(),
            "async_stall_ratio": spread([s["call_s"] / sync_save for s in stalls]).text()},
    }


def report(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    f = figures
    engine = "FSDP2 (DCP shards)" if args.engine == "fsdp2" else "ZeRO-2"
    print(f"GPT {args.layers} layers x {args.hidden} hidden, {f['parameters'] / 1e6:.1f} M parameters, "
          f"{f['ranks']} ranks, {engine}, {args.precision}, checkpoint.verify = {args.verify}; one checkpoint: "
          f"{f['checkpoint_mb']:.1f} MB in {f['files']} files; {args.saves} repetitions (medians); "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'':44} {'seconds':>8} {'MB/s':>7} {'ratio':>6}  target")
    print(f"{'save, synchronous, whole transaction':44} {f['save_s']:8.3f} {f['save_mb_s']:7.0f} "
          f"{f['save_ratio']:6.3f}  >= 0.80 of raw speed: {'met' if f['save_ratio'] >= 0.8 else 'NOT met'}")
    print(f"{'  raw writes of the same bytes, fsynced':44} {f['save_raw_s']:8.3f} {f['raw_write_mb_s']:7.0f}")
    cache = "cold cache" if f["load_cold_cache"] else "WARM cache (not root: caches not dropped)"
    print(f"{'load (resume), ' + cache:44} {f['load_s']:8.3f} {f['checkpoint_mb'] / f['load_s']:7.0f} "
          f"{f['load_ratio']:6.3f}  <= 1.30x raw time: {'met' if f['load_ratio'] <= 1.3 else 'NOT met'}")
    print(f"{'  raw reads of the same files':44} {f['load_raw_s']:8.3f} {f['raw_read_mb_s']:7.0f}")
    if f["load_hash_s"]:
        print(f"{'  sha256 alone of the same bytes (hashlib)':44} {f['load_hash_s']:8.3f} "
              f"{f['checkpoint_mb'] / f['load_hash_s']:7.0f} {f['load_hash_s'] / f['load_raw_s']:6.3f}  "
              f"(every rank at once; the raw read plus this: "
              f"{(f['load_raw_s'] + f['load_hash_s']) / f['load_raw_s']:.3f}x)")
    print(f"{'async save: stall (call, and the step waiting)':44} {f['async_stall_s']:8.3f} {'':7} "
          f"{f['async_stall_ratio']:6.3f}  <= 0.10 of a sync save: "
          f"{'met' if f['async_stall_ratio'] <= 0.1 else 'NOT met'}")
    print(f"{'  of it the next step waiting for the copies':44} {f['async_settle_s']:8.3f}")
    print(f"{'  steps slower while the files are written':44} {f['async_slowed_steps_s']:8.3f} {'':7} "
          f"{f['async_slowed_ratio']:6.3f}  (CPU the writer threads share with training)")
    print(f"{'  a plain training step':44} {f['plain_step_s']:8.3f}")
    print(f"{'  durable after the steps that followed':44} {f['async_durable_after_s']:8.3f}")
    for name, text in f["spreads"].items():
        print(f"{name} over the repetitions: {text}")
    for kind, profile in f.get("profiles", {}).items():
        print(f"profile of one more {kind} on rank 0 (cProfile, {profile['total_s']:.3f} s under it, warm cache; "
              f"threads other than the main one are not profiled; {profile['file']}):")
        for part, seconds in profile["parts"]:
            print(f"  {part:50} {seconds:8.3f}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3, help="repetitions of each measurement")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps-during", type=int, default=3, help="training steps run while an async save writes")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--engine", choices=("deepspeed", "fsdp2"), default="deepspeed",
                        help="deepspeed: ZeRO-2 and its checkpoint files; fsdp2: FSDP2 and DCP shards")
    parser.add_argument("--verify", choices=("size", "sha256"), default="sha256",
                        help="checkpoint.verify: what the load checks (sha256: hashed while read)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: does it still run")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object last")
    parser.add_argument("--dir", type=Path, default=None, help="where the run folder goes (default: a temp folder)")
    parser.add_argument("--profile", action="store_true", help="one more save and load on rank 0 under cProfile: "
                        "where their time goes")
    args = parser.parse_args()
    if args.smoke:
        args.saves, args.layers, args.hidden, args.heads, args.steps_during = 1, 1, 64, 2, 1
    print(machine().line(), flush=True)  # before the ranks start: their own load is not counted
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir(mode=0o700)
        figures = summarize(run_ranks(args, run_dir))
    report(args, figures)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
