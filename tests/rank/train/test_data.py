"""Data pipeline: deterministic sources, disjoint data-parallel slices, exact resume, and token files from text."""

from __future__ import annotations

import math
import re
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_train.errors import ConfigError
from hpc_train.login import prepare
from hpc_train.rank.train import data
from tests.conftest import PYTHON, REPO, call_cli

CORPUS = REPO / "examples" / "corpus" / "hpc_train_docs.txt"


def global_stream(num_samples: int, dp_size: int, micro_batch: int, steps: int, seed: int = 3,
                  state: dict[str, int] | None = None, grad_accum: int = 1) -> tuple[list[int], dict[str, int]]:
    """Run one sampler per data-parallel rank for ``steps`` global batches; the concatenated order and the state."""
    samplers = [data.ResumableSampler(num_samples, rank, dp_size, micro_batch, seed, grad_accum=grad_accum)
                for rank in range(dp_size)]
    if state is not None:
        for sampler in samplers:
            sampler.load_state_dict(state)
    stream: list[int] = []
    for _ in range(steps * grad_accum):
        for sampler in samplers:
            stream += sampler.next_indices()
    states = {str(sampler.state_dict()) for sampler in samplers}
    assert len(states) == 1, "every rank must hold the same global position"
    return stream, samplers[0].state_dict()


# --- sources -----------------------------------------------------------------------------------------------------

def test_synthetic_is_deterministic_per_index_and_seed() -> None:
    one, two = data.SyntheticTokens(256, seed=5), data.SyntheticTokens(256, seed=5)
    assert np.array_equal(one.sample(17, 64), two.sample(17, 64))
    sample = one.sample(17, 64)
    assert sample.dtype == np.int64 and sample.shape == (65,) and sample.min() >= 0 and sample.max() < 256
    assert not np.array_equal(one.sample(17, 64), one.sample(18, 64))
    assert not np.array_equal(one.sample(17, 64), data.SyntheticTokens(256, seed=6).sample(17, 64))
    assert one.num_samples(64) == one.num_samples(2048) == 1 << 16


def test_synthetic_is_learnable() -> None:
    """The bigram entropy is far below log(vocab): a model can push the loss well under a uniform guess."""
    source = data.SyntheticTokens(256, seed=1234)
    tokens = np.stack([source.sample(i, 128) for i in range(300)])
    pairs = Counter(zip(tokens[:, :-1].ravel().tolist(), tokens[:, 1:].ravel().tolist(), strict=True))
    firsts = Counter(tokens[:, :-1].ravel().tolist())
    total = sum(pairs.values())
    conditional = -sum(n / total * math.log(n / firsts[a]) for (a, _), n in pairs.items())
    unigram = -sum(n / total * math.log(n / total) for n in firsts.values())
    assert conditional < 0.25 * math.log(256) and conditional <= source.entropy + 0.05
    assert unigram > 0.8 * math.log(256), "tokens should still cover the vocabulary"


def test_synthetic_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        data.SyntheticTokens(1, seed=0)
    with pytest.raises(IndexError):
        data.SyntheticTokens(256, seed=0, num_samples=4).sample(4, 8)


def test_make_source_chooses_and_explains(tmp_path: Path) -> None:
    assert isinstance(data.make_source("synthetic", "", 256, 0), data.SyntheticTokens)
    path = tmp_path / "t.u16"
    np.arange(100, dtype="<u2").tofile(path)
    assert isinstance(data.make_source("tokens", str(path), 256, 0), data.TokenFile)
    with pytest.raises(ConfigError, match=r'data.source: unknown source "token".*did you mean "tokens"'):
        data.make_source("token", str(path), 256, 0)
    with pytest.raises(ConfigError, match=r"data.path: is empty.*hpc_train.login.prepare"):
        data.make_source("tokens", "", 256, 0)


# --- token files -------------------------------------------------------------------------------------------------

def test_token_file_round_trip_through_prepare(tmp_path: Path) -> None:
    out = tmp_path / "docs.u16"
    count = prepare.prepare_text(CORPUS, out)
    text = CORPUS.read_bytes()
    assert count == len(text) == out.stat().st_size // 2
    assert out.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["docs.u16"], "no temp file left behind"
    tokens = data.TokenFile(out, 256)
    seq_len = 128
    assert tokens.num_samples(seq_len) == (len(text) - 1) // seq_len
    for index in (0, 1, tokens.num_samples(seq_len) - 1):
        expected = np.frombuffer(text[index * seq_len:index * seq_len + seq_len + 1], dtype=np.uint8)
        assert np.array_equal(tokens.sample(index, seq_len), expected.astype(np.int64))
    with pytest.raises(IndexError):
        tokens.sample(tokens.num_samples(seq_len), seq_len)


def test_token_file_format_is_little_endian_uint16(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(b"AB\xff")
    prepare.prepare_text(text, tmp_path / "t.u16")
    assert (tmp_path / "t.u16").read_bytes() == b"A\x00B\x00\xff\x00"


def test_prepare_replaces_an_existing_file_atomically(tmp_path: Path) -> None:
    text, out = tmp_path / "t.txt", tmp_path / "t.u16"
    text.write_bytes(b"hello")
    out.write_bytes(b"old")
    assert prepare.prepare_text(text, out) == 5
    assert out.read_bytes() == b"h\x00e\x00l\x00l\x00o\x00"


def token_file(tmp_path: Path, payload: bytes) -> Path:
    path = tmp_path / "bad.u16"
    path.write_bytes(payload)
    return path


@pytest.mark.parametrize(("payload", "vocab", "seq_len", "message"), [
    (None, 256, 8, r"bad.u16: no such token file.*Fix: write it with: python -m hpc_train.login.prepare"),
    (b"", 256, 8, r"bad.u16: token file is empty.*Fix: write it with"),
    (b"\x01\x00\x02", 256, 8, r"bad.u16: size 3 bytes is odd.*Fix: write it with"),
    (np.array([1, 2, 300], dtype="<u2").tobytes(), 256, 1,
     r"bad.u16: token 300 at position 2 is not below vocab_size 256.*Fix: set data.vocab_size"),
    (np.arange(5, dtype="<u2").tobytes(), 256, 8,
     r"bad.u16: holds 5 tokens, fewer than seq_len \+ 1 = 9.*Fix: prepare a larger text, or lower train.seq_len"),
    (np.arange(5, dtype="<u2").tobytes(), 70000, 1, r"data.vocab_size: 70000 is outside 1..65536"),
])
def test_token_file_refusals_name_the_file_and_the_fix(tmp_path: Path, payload: bytes | None, vocab: int,
                                                       seq_len: int, message: str) -> None:
    path = tmp_path / "bad.u16" if payload is None else token_file(tmp_path, payload)
    with pytest.raises(ValueError, match=message):
        data.TokenFile(path, vocab).num_samples(seq_len)


def test_token_file_checks_tokens_past_the_prefix_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "_PREFIX_CHECK", 8)
    tokens = np.arange(40, dtype="<u2") % 10
    tokens[30] = 999
    source = data.TokenFile(token_file(tmp_path, tokens.tobytes()), 256)
    assert source.sample(1, 8).tolist() == tokens[8:17].tolist()
    with pytest.raises(ValueError, match="token 999 at position 30"):
        source.sample(3, 8)


# --- prepare command ---------------------------------------------------------------------------------------------

def test_prepare_cli_prints_the_count(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("hi there", encoding="utf-8")
    result = call_cli(prepare.main, ["t.txt", "t.u16"], tmp_path)
    assert result.code == 0 and "wrote 8 tokens to t.u16" in result.out and result.err == ""


@pytest.mark.parametrize(("args", "message"), [
    (["missing.txt", "out.u16"], r"^error: missing.txt: no such file. Fix: give an existing text file\n$"),
    (["empty.txt", "out.u16"], r"^error: empty.txt: is empty, so there are no tokens. Fix: give a text file"),
    (["t.txt", "nope/out.u16"], r"^error: nope/out.u16: folder nope does not exist. Fix: create it first\n$"),
    (["t.txt", "sub"], r"^error: sub: is a folder. Fix: give a file name"),
    (["sub", "out.u16"], r"^error: sub: is a folder. Fix: give an existing text file\n$"),
    (["t.txt", "t.txt"], r"^error: t.txt: is the input text file"),
])
def test_prepare_cli_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "t.txt").write_text("text", encoding="utf-8")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = call_cli(prepare.main, args, tmp_path)
    assert result.code == 2 and result.out == ""
    assert result.err.count("\n") == 1 and re.match(message, result.err), result.err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "text"


def test_prepare_cli_unwritable_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**_: object) -> None:
        raise PermissionError(13, "Permission denied")

    (tmp_path / "t.txt").write_text("text", encoding="utf-8")
    monkeypatch.setattr(prepare.tempfile, "mkstemp", refuse)  # as root a real read-only folder would not refuse
    result = call_cli(prepare.main, ["t.txt", "out.u16"], tmp_path)
    assert result.code == 2
    assert result.err == "error: out.u16: cannot write in .: Permission denied. Fix: choose a writable folder\n"


def test_prepare_cli_failure_while_writing_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(_: int) -> None:
        raise OSError(28, "No space left on device")

    (tmp_path / "t.txt").write_text("text", encoding="utf-8")
    (tmp_path / "out.u16").write_bytes(b"old")
    monkeypatch.setattr(prepare.os, "fsync", disk_full)
    result = call_cli(prepare.main, ["t.txt", "out.u16"], tmp_path)
    assert result.code == 1 and result.err == "error: out.u16: No space left on device\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.u16", "t.txt"]
    assert (tmp_path / "out.u16").read_bytes() == b"old"


def test_prepare_module_runs_without_numpy_or_torch(tmp_path: Path) -> None:
    """The login-node path: ``python -m`` works and pulls in neither numpy nor torch."""
    (tmp_path / "t.txt").write_text("abc", encoding="utf-8")
    code = ("import runpy, sys; sys.argv = ['prepare', 't.txt', 't.u16']\n"
            "try:\n    runpy.run_module('hpc_train.login.prepare', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = sorted({'numpy', 'torch'} & set(sys.modules)); assert not heavy, heavy")
    done = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "wrote 3 tokens" in done.stdout
    assert (tmp_path / "t.u16").stat().st_size == 6


# --- sampler -----------------------------------------------------------------------------------------------------

def test_sampler_ranks_split_each_global_batch_and_cover_the_epoch() -> None:
    num_samples, dp_size, micro_batch = 50, 3, 4  # global batch 12: 4 per epoch, 2 samples dropped
    samplers = [data.ResumableSampler(num_samples, rank, dp_size, micro_batch, seed=9) for rank in range(dp_size)]
    epoch: list[int] = []
    for _ in range(samplers[0].batches_per_epoch):
        slices = [sampler.next_indices() for sampler in samplers]
        assert all(len(part) == micro_batch for part in slices)
        flat = [index for part in slices for index in part]
        assert len(set(flat)) == len(flat) == 12, "ranks overlap within a global batch"
        epoch += flat
    assert len(set(epoch)) == len(epoch) == 48 and set(epoch) <= set(range(num_samples))
    assert samplers[0].state_dict() == {"epoch": 1, "offset": 0}
    order = np.random.default_rng([9, 2, 0]).permutation(num_samples).tolist()
    assert epoch == order[:48], "global batches are consecutive positions of the epoch's permutation"


def test_sampler_epochs_differ_and_are_the_same_on_every_rank() -> None:
    one, _ = global_stream(40, 2, 5, steps=8, seed=1)
    two, state = global_stream(40, 2, 5, steps=8, seed=1)
    assert one == two and state == {"epoch": 2, "offset": 0}
    assert sorted(one[:40]) == sorted(one[40:]) == list(range(40)) and one[:40] != one[40:]
    assert global_stream(40, 2, 5, steps=4, seed=2)[0] != one[:40]


def test_sampler_without_shuffle_is_in_order() -> None:
    sampler = data.ResumableSampler(10, 1, 2, 2, seed=0, shuffle=False)
    assert [sampler.next_indices() for _ in range(3)] == [[2, 3], [6, 7], [2, 3]]


@pytest.mark.parametrize("steps_before", [1, 3, 5, 6, 11])
def test_sampler_resume_is_exactly_the_uninterrupted_run(steps_before: int) -> None:
    uninterrupted, end_state = global_stream(52, 2, 4, steps=14)
    first, saved = global_stream(52, 2, 4, steps=steps_before)
    rest, resumed_end = global_stream(52, 2, 4, steps=14 - steps_before, state=dict(saved))
    assert first + rest == uninterrupted and resumed_end == end_state


@pytest.mark.parametrize(("old", "steps_before", "new"), [
    ((2, 4), 3, (1, 4)),  # dp 2 -> 1
    ((1, 2), 4, (4, 2)),  # dp 1 -> 4
    ((4, 1), 3, (2, 2)),  # dp 4 -> 2
    ((2, 4), 6, (1, 4)),  # saved exactly at an epoch boundary
])
def test_sampler_resume_at_another_data_parallel_size_continues_the_global_order(
        old: tuple[int, int], steps_before: int, new: tuple[int, int]) -> None:
    """Same global position, other (dp_size, micro_batch): the global sample order carries on unchanged."""
    num_samples = 48  # a multiple of every global batch here, so epochs end at the same place
    reference, _ = global_stream(num_samples, 1, 1, steps=80)
    first, saved = global_stream(num_samples, old[0], old[1], steps=steps_before)
    assert saved["offset"] % (new[0] * new[1]) == 0
    steps = (80 - len(first)) // (new[0] * new[1])
    rest, _ = global_stream(num_samples, new[0], new[1], steps=steps, state=saved)
    assert first + rest == reference


@pytest.mark.parametrize(("old", "new"), [((4, 1), (2, 2)), ((4, 1), (1, 4)), ((1, 4), (2, 2)), ((2, 2), (4, 1))])
def test_layouts_with_one_global_batch_take_the_same_samples_across_epochs_and_resume_in_each_other(
        old: tuple[int, int], new: tuple[int, int]) -> None:
    """(dp_size, grad_accum) with the same global batch of 4, 10 samples (2 steps an epoch, 2 dropped): as
    ``retry.shrink`` changes the size inside a run, every step must see the same samples, past an epoch's end
    too, and a position saved at one size must load at the other."""
    reference, end = global_stream(10, old[0], 1, steps=7, grad_accum=old[1])
    assert global_stream(10, new[0], 1, steps=7, grad_accum=new[1]) == (reference, end)
    assert end == {"epoch": 3, "offset": 4}
    first, saved = global_stream(10, old[0], 1, steps=3, grad_accum=old[1])
    assert saved == {"epoch": 1, "offset": 4}
    rest, resumed_end = global_stream(10, new[0], 1, steps=4, grad_accum=new[1], state=saved)
    assert first + rest == reference and resumed_end == end


def test_an_epoch_ends_only_at_a_step_s_boundary() -> None:
    """10 samples, micro-steps of 2, 3 of them a step: the second step would run past the epoch, so the epoch ends
    after the first step's 6 samples, never inside a step."""
    sampler = data.ResumableSampler(10, 0, 1, 2, seed=0, shuffle=False, grad_accum=3)
    assert [sampler.next_indices() for _ in range(6)] == [[0, 1], [2, 3], [4, 5]] * 2
    assert sampler.batches_per_epoch == 1 and sampler.state_dict() == {"epoch": 2, "offset": 0}


def test_sampler_resume_refuses_a_global_batch_that_does_not_divide_the_offset() -> None:
    _, saved = global_stream(48, 1, 2, steps=3)  # offset 6
    sampler = data.ResumableSampler(48, 0, 4, 1, seed=3)
    with pytest.raises(ValueError, match=r"offset 6 .* micro_batch 1 x dp_size 4 = 4"):
        sampler.load_state_dict(saved)


@pytest.mark.parametrize(("state", "message"), [
    ({"epoch": 0}, "needs integer 'epoch' and 'offset'"),
    ({"epoch": "x", "offset": 0}, "needs integer 'epoch' and 'offset'"),
    ({"epoch": -1, "offset": 0}, "outside this data set of 48 samples"),
    ({"epoch": 0, "offset": 96}, "outside this data set of 48 samples"),
])
def test_sampler_refuses_broken_state(state: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        data.ResumableSampler(48, 0, 1, 4, seed=0).load_state_dict(state)  # type: ignore[arg-type]


@pytest.mark.parametrize(("args", "message"), [
    ((10, 2, 2, 1), r"dp_rank 2 is outside 0..1"),
    ((10, 0, 0, 1), r"dp_rank 0 is outside"),
    ((10, 0, 1, 0), r"micro_batch 0"),
    ((10, 0, 4, 3), r"10 samples are fewer than one global batch of 12 = micro_batch 3 x dp_size 4;"),
    ((10, 0, 2, 2, 3), r"fewer than one global batch of 12 = micro_batch 2 x dp_size 2 x grad_accum 3"),
    ((10, 0, 1, 1, 0), r"grad_accum 0 must be at least 1"),
])
def test_sampler_refuses_bad_sizes(args: tuple[int, ...], message: str) -> None:
    num_samples, dp_rank, dp_size, micro_batch, *accum = args
    with pytest.raises(ValueError, match=message):
        data.ResumableSampler(num_samples, dp_rank, dp_size, micro_batch, seed=0, grad_accum=accum[0] if accum else 1)


def test_sampler_state_at_the_end_of_an_epoch_resumes_in_the_next() -> None:
    sampler = data.ResumableSampler(10, 0, 1, 4, seed=0)
    sampler.load_state_dict({"epoch": 0, "offset": 8})  # only 2 left: less than a global batch
    assert sampler.state_dict() == {"epoch": 1, "offset": 0}


# --- batch -------------------------------------------------------------------------------------------------------

def test_batch_shifts_targets_by_one() -> None:
    source = data.SyntheticTokens(256, seed=0)
    inputs, targets = data.batch(source, [3, 1, 4], seq_len=16)
    assert inputs.shape == targets.shape == (3, 16) and inputs.dtype == targets.dtype == torch.long
    assert inputs.is_contiguous() and targets.is_contiguous()
    rows = [torch.from_numpy(source.sample(i, 16)) for i in (3, 1, 4)]
    assert torch.equal(inputs, torch.stack([row[:-1] for row in rows]))
    assert torch.equal(targets, torch.stack([row[1:] for row in rows]))
    with pytest.raises(ValueError, match="no sample indices"):
        data.batch(source, [], 16)
