"""A seeded fuzzer over job files: every key of the real schema, hostile values, ``ds_config.json`` files and
``--set``, run through ``validate`` and ``submit --dry-run --json`` in this process.

Why: each surface of the config was written with its own checks, and a held-out set of hostile inputs found
what they missed (an OverflowError from ``spare_nodes = 2**62``, a W&B key echoed by ``--json``, fp16 and bf16
both on, a 100,000-deep ``ds_config.json``). The same few rules must hold for every key, so the cases are made
from the schema itself (:func:`schema_keys` walks the dataclasses; a new key is fuzzed the day it is added) and
every case asserts them all through the corpus harness (:func:`tests.security.harness.run_case`): exit 0 or 2,
no traceback, no "unexpected failure", an answer within 2 s, nothing written (a dry run and ``validate`` write
nothing, whatever the exit), no secret in any output, and ``--json`` that strict JSON readers take.

CI runs ``DEFAULT_CASES`` cases from a fixed seed (about 10-20 s); ``HPC_TRAIN_FUZZ_CASES=5000`` (and
``HPC_TRAIN_FUZZ_SEED``) runs longer, before a release. A failure names its case number and seed, and the
job file and ds_config.json it used, so it can be turned into a regression case.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest

from hpc_train.config.deepspeed import deepspeed_config
from hpc_train.config.ds_import import PLAIN_KEYS
from hpc_train.config.job import JobConfig
from hpc_train.config.loader import field_types, rebuild
from hpc_train.config.secrets import REDACTED
from tests.security.harness import Case, World, make_world, run_case

DEFAULT_CASES = 1200
CASES = int(os.environ.get("HPC_TRAIN_FUZZ_CASES", DEFAULT_CASES))
SEED = int(os.environ.get("HPC_TRAIN_FUZZ_SEED", "20240639"))
FREE = object()  # a free table's "key": the table itself is fuzzed


class Raw(str):
    """Text written into the TOML or JSON file as it is (a deep nesting, a date, a 400-digit integer)."""


def schema_keys() -> list[tuple[str, Any, Any]]:
    """(section, key, type) for every key of the job schema; a free table ([env], [params], [deepspeed]) once,
    with FREE as its key."""
    keys: list[tuple[str, Any, Any]] = []
    for section, kind in field_types(JobConfig).items():
        if dataclasses.is_dataclass(kind):
            keys += [(section, name, hint) for name, hint in field_types(kind).items()]
        else:
            keys.append((section, FREE, kind))
    return keys


def default_of(section: str, key: str) -> Any:
    return getattr(getattr(JobConfig(), section), key)


# -- values --------------------------------------------------------------------------------------------------

_BIG = [0, -1, 1, 2, 3, 7, 64, 1023, 2**31, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), Raw("1" + "0" * 400),
        Raw("-" + "9" * 25)]
_FLOATS = [0.0, -0.0, -1.0, 0.5, 1.0, 1e-9, 5e-324, 1e308, -1e308, float("nan"), float("inf"), float("-inf"),
           Raw("1e999"), 0.999999, 1.0000001]
_STRINGS = ["", " ", "a", "a\nb", "line\r\nfeed", "\x1b[31mred\x1b[0m", "\x1b]0;title\x07", "#SBATCH --wrap=id",
            "x\n#SBATCH --wrap=touch /tmp/canary", "$(touch canary)", "`id`", "a;b", "'", '"', "\\", "\t",
            "\x00", "\x7f", "\u202eevil", "\u2028", "été", "日本", "../../etc/passwd", "/dev/zero", "-", "--help",
            "a" * 5000, "b" * 70_000, "auto", "none", "null", "0", "-1", "1e308", "nan", "train", "smoke",
            "tiny", "synthetic", "tokens", "USR1", "USR2", "00:00:01", "99:99:99", "1-00:00:00", "node[1-",
            "n[5-1]", "x.py:f", "pkg.mod:fn", "%s%n", "{}", "[]", "<redacted>", "*", "?"]
_DEEP = [Raw("[" * 40 + "]" * 40), Raw("[" * 5000 + "]" * 5000), Raw("{a = " * 40 + "1" + "}" * 40)]
_DATES = [Raw("1979-05-27"), Raw("07:32:00"), Raw("1979-05-27T07:32:00Z")]
_SECRET_NAMES = ["api_key", "apiKey", "token", "hf_token", "password", "passwd", "secret", "client_secret",
                 "credentials", "WANDB_API_KEY", "auth_token", "private_key"]


def _random_text(rng: random.Random, size: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(rng.choice(alphabet) for _ in range(size))


def secret_token(rng: random.Random) -> str:
    """A credential of a shape the rule knows (a prefix, a URL password, a web token, a long random string)."""
    body = _random_text(rng, 36)
    random_run = "Q" + "z" + "".join(ch if i % 6 else rng.choice("23456789") for i, ch in enumerate(body[:30]))
    return rng.choice([f"ghp_{body}", f"hf_{body[:34]}", f"sk-proj-{body}", f"glpat-{body[:20]}",
                       f"xoxb-{rng.randrange(10**11, 10**12)}-{body[:16]}", "AKIA" + _random_text(
                           rng, 16, string.ascii_uppercase + string.digits), f"github_pat_11{body[:22]}",
                       f"https://alice:{body[:10]}@git.example.org/x", f"eyJ{body[:12]}.eyJ{body[12:24]}.x",
                       random_run, f"pypi-{body}"])


@dataclass
class Draw:
    """What one case puts where, and the secrets it must never print."""

    rng: random.Random
    secrets: list[str] = field(default_factory=list)

    def secret(self) -> str:
        value = secret_token(self.rng)
        self.secrets.append(value)
        return value

    def named_secret(self) -> str:
        """A value that is a secret only by the key it is under: unique, so a grep finds exactly it."""
        value = f"v4lue{self.rng.randrange(16**12):012x}"
        self.secrets.append(value)
        return value


def _of_type(draw: Draw, kind: Any) -> Any:
    """A value meant for ``kind``: in range, at an edge, far outside, or of another type."""
    rng = draw.rng
    origin = get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        return _of_type(draw, rng.choice([arg for arg in get_args(kind) if arg is not type(None)]))
    if origin is Literal:
        choice = str(rng.choice(get_args(kind)))
        return rng.choice([choice, choice.upper(), choice + "\n", " " + choice, choice[:-1]])
    if origin is list:
        return [_of_type(draw, get_args(kind)[0]) for _ in range(rng.choice([0, 1, 2, 3]))]
    if kind is bool:
        return rng.choice([True, False])
    if kind is int:
        return rng.choice([*_BIG, rng.randint(-10**6, 10**6)])
    if kind is float:
        return rng.choice([*_FLOATS, rng.uniform(-10, 10)])
    return rng.choice([*_STRINGS, draw.secret()])


_SANE = {int: [1, 2, 4, 8, 10, 100], float: [0.1, 0.5, 0.9, 1e-3, 2.0], bool: [True, False]}


def sane_for(draw: Draw, section: str, key: str, kind: Any) -> Any:
    """A value a careful user might write: the default, or a small number of the key's type; so that the
    hostile key of a case meets the checks after the first."""
    default = default_of(section, key)
    inner = [arg for arg in get_args(kind) if arg is not type(None)] if get_origin(kind) else [kind]
    pool = _SANE.get(inner[0], []) if len(inner) == 1 else []
    return draw.rng.choice(pool) if pool and draw.rng.random() < 0.5 else default


def value_for(draw: Draw, kind: Any) -> Any:
    """Mostly a value of the key's own type; sometimes another type, a date, a deep nesting or a secret."""
    roll = draw.rng.random()
    if roll < 0.6:
        return _of_type(draw, kind)
    if roll < 0.75:
        return draw.rng.choice([True, "12", [1, 2], {"a": 1}, 3.5, -7, *_DATES])
    if roll < 0.85:
        return draw.secret()
    return draw.rng.choice(_DEEP + _BIG[-2:] + _FLOATS[9:12])


def free_table(draw: Draw, section: str) -> dict[str, Any]:
    """[env], [params] or [deepspeed]: names that mean something (a credential, a shell variable), odd names,
    nested tables, and hostile values."""
    rng = draw.rng
    names = ["x", "A_B", "BASH_ENV", "LD_PRELOAD", "PYTHONPATH", "TOKENIZERS_PARALLELISM", "pad_token", "été",
             "a b", "", "x" * 200, "zero_optimization", "optimizer", "fp16", "wandb"]
    table: dict[str, Any] = {}
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.35:
            table[rng.choice(_SECRET_NAMES)] = draw.named_secret()
        else:
            key = rng.choice(names)
            table[key] = {"api_key": draw.named_secret()} if rng.random() < 0.2 else value_for(draw, str)
    return table


# -- files ---------------------------------------------------------------------------------------------------


def toml_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch for ch in escaped) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return "{" + ", ".join(f"{toml_string(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_file(sections: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, table in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{toml_string(str(key))} = {toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


_DS_PATHS = [("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",), ("train_batch_size",),
             ("gradient_clipping",), ("zero_optimization", "stage"), ("zero_optimization", "reduce_bucket_size"),
             ("zero_optimization", "offload_optimizer", "device"), ("zero_optimization", "offload_param", "device"),
             ("optimizer", "type"), ("optimizer", "params", "lr"), ("optimizer", "params", "betas"),
             ("optimizer", "params", "eps"), ("optimizer", "params", "weight_decay"), ("scheduler", "type"),
             ("scheduler", "params", "warmup_num_steps"), ("scheduler", "params", "warmup_max_lr"),
             ("fp16", "enabled"), ("bf16", "enabled"), ("bfloat16", "enabled"), ("amp", "enabled"),
             ("fp16", "initial_scale_power"), ("fp16", "loss_scale"), ("wandb", "project"),
             ("steps_per_print",), ("wall_clock_breakdown",), ("comet", "workspace")]
_DS_VALUES = [0, 1, -1, 2, 3, 4, 2**62, 1e308, -1e308, 0.5, 1e-8, "auto", "cpu", "nvme", "AdamW", "Lamb",
              "WarmupLR", True, False, None, [0.9, 0.95], [0.9, 0.95, 0.99], [2, 0.9], ["a", "b"], {}, "x\ny",
              "\x1b[2J"]


def ds_config(draw: Draw) -> str:
    """A ds_config.json: a plausible file with hostile values at DeepSpeed's keys, a logger section with a
    credential, and now and then what is not JSON at all."""
    rng = draw.rng
    data: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": rng.randint(0, 3)}}
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        path = rng.choice(_DS_PATHS)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        node[path[-1]] = rng.choice(_DS_VALUES)
    if rng.random() < 0.5:
        section = rng.choice(["wandb", "comet", "csv_monitor", "tensorboard"])
        data[section] = {"enabled": True, rng.choice(["api_key", "apiKey", "token", "api_token"]):
                         rng.choice([draw.named_secret(), draw.secret()])}
    text = json.dumps(data)
    roll = rng.random()
    if roll < 0.05:
        return text[:-1] + ', "x": NaN}'
    if roll < 0.1:
        return '{"a": ' + "[" * rng.choice([40, 100_000]) + "]" * 100_000 + "}"
    if roll < 0.13:
        return '{"a": ' + "7" * 5000 + "}"
    if roll < 0.15:
        return rng.choice(["[]", "null", "{", "\ufeff{}", '{"a": 1e999}'])
    return text


@dataclass(frozen=True)
class FuzzCase:
    """One drawn case: its job file, ds_config.json (or none), extra arguments and the secrets it holds."""

    number: int
    job: str
    ds: str | None
    argv: tuple[str, ...]
    secrets: tuple[str, ...]


def draw_case(number: int, keys: list[tuple[str, Any, Any]], seed: int) -> FuzzCase:
    """Case ``number`` sets key ``number % len(keys)`` (so every key is fuzzed in every run of len(keys) cases
    or more), one to three other keys at random, and some of them through ``--set``."""
    draw = Draw(random.Random(f"{seed}:{number}"))  # noqa: S311 (a reproducible draw, not a key)
    rng = draw.rng
    chosen = [keys[number % len(keys)], *rng.sample(keys, rng.randint(0, 3))]
    sections: dict[str, dict[str, Any]] = {"job": {"run_root": "@RUNS@"}}
    overrides: list[str] = []
    for index, (section, key, kind) in enumerate(chosen):
        if key is FREE:
            sections.setdefault(section, {}).update(free_table(draw, section))
            continue
        hostile = (index == 0 and number % 4 != 3) or rng.random() < 0.15  # a quarter: a careful user's file
        value = value_for(draw, kind) if hostile else sane_for(draw, section, key, kind)
        if value is None:
            continue
        if rng.random() < 0.25 and not isinstance(value, dict):
            overrides += ["--set", f"{section}.{key}={value if isinstance(value, str) else toml_value(value)}"]
        else:
            sections.setdefault(section, {})[key] = value
    ds = ds_config(draw) if rng.random() < 0.3 else None
    if ds is not None:
        if rng.random() < 0.5:
            overrides += ["--set", "train.deepspeed_config=ds_config.json"]
        else:
            sections.setdefault("train", {})["deepspeed_config"] = "ds_config.json"
    return FuzzCase(number, toml_file(sections), ds, tuple(overrides), tuple(draw.secrets))


# -- running -------------------------------------------------------------------------------------------------


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} in --json output")


def out_of_range(config: Any, where: str = "") -> list[str]:
    """The keys of an accepted config whose number is outside the range its schema declares."""
    bad = []
    for item in dataclasses.fields(config):
        value, name = getattr(config, item.name), f"{where}.{item.name}" if where else item.name
        if dataclasses.is_dataclass(value):
            bad += out_of_range(value, name)
            continue
        bounds = item.metadata.get("range")
        numbers = value if isinstance(value, list) else [value]
        bad += [name for number in numbers if bounds is not None and isinstance(number, int | float)
                and not isinstance(number, bool) and bounds.problem(number)]
    return bad


def accepted_as_deepspeed_would(printed: dict[str, Any]) -> None:
    """An accepted plan: every number in its range, and the DeepSpeed config it implies one DeepSpeed takes
    (one number format, two betas) with no placeholder of a credential in it."""
    plan = printed.get("plan", printed)
    plan = plan[0] if isinstance(plan, list) else plan
    config = rebuild(JobConfig, plan["config"])
    assert not out_of_range(config), f"accepted out of range: {out_of_range(config)}"
    ds = deepspeed_config(config, plan["layout"]["data"])
    sections = {name: ds.get(name) for name in ("fp16", "bf16", "bfloat16", "amp", "optimizer")}
    assert all(isinstance(value, dict | None) for value in sections.values()), f"accepted sections {sections}"
    formats = [name for name, value in sections.items() if name != "optimizer" and (value or {}).get("enabled") is True]
    assert len(formats) <= 1, f"accepted {formats} together"
    params = (sections["optimizer"] or {}).get("params", {})
    betas = params.get("betas") if isinstance(params, dict) else None
    assert betas is None or len(betas) == 2, f"accepted betas {betas}"
    assert REDACTED not in json.dumps(ds), "a credential's placeholder would reach DeepSpeed"


def _flat(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def file_honoured(fuzz: FuzzCase, printed: dict[str, Any]) -> None:
    """An accepted ds_config.json is applied, whether the job file or --set names it: each key hpc_train
    models has the file's value in the plan (unless --set gave that key), and nothing is silently dropped
    (three betas, or fp16 and bf16 both on, cannot both be honoured and accepted)."""
    named = "deepspeed_config" in fuzz.job or any("train.deepspeed_config" in arg for arg in fuzz.argv)
    if fuzz.ds is None or not named:
        return
    plan = printed.get("plan", printed)
    config = plan["config"]
    given = {arg.partition("=")[0] for arg in fuzz.argv}
    flat = _flat(json.loads(fuzz.ds))
    expected = [(typed, flat[path]) for path, typed in PLAIN_KEYS.items() if path in flat and flat[path] != "auto"]
    betas = flat.get(("optimizer", "params", "betas"))
    if betas is not None and betas != "auto":
        assert isinstance(betas, list) and len(betas) == 2, f"accepted betas {betas} (DeepSpeed refuses them)"
        expected += [("train.beta1", betas[0]), ("train.beta2", betas[1])]
    expected += [("train.precision", name) for name in ("fp16", "bf16") if flat.get((name, "enabled")) is True]
    for typed, value in expected:
        section, _, key = typed.partition(".")
        if typed not in given and key not in ("global_batch",):
            assert config[section][key] == value, f"{typed} = {config[section][key]!r}, the file says {value!r}"


def _oracle(fuzz: FuzzCase):
    """What run_case cannot know: no secret of this case in what was printed, --json is strict JSON, and what
    was accepted is what DeepSpeed and the schema's ranges accept."""

    def check(world: World, outcome: Any) -> None:
        said = outcome.out + outcome.err
        leaked = [secret for secret in fuzz.secrets if secret in said]
        assert not leaked, f"a secret was printed: {leaked[0][:12]}..."
        if outcome.code == 0:
            printed = json.loads(outcome.out, parse_constant=_no_constants)
            accepted_as_deepspeed_would(printed)
            file_honoured(fuzz, printed)

    return check


def _case_for(fuzz: FuzzCase) -> Case:
    write_ds = None
    if fuzz.ds is not None:
        text = fuzz.ds

        def write_ds(world: World) -> None:
            (world.work / "ds_config.json").write_text(text, encoding="utf-8")

    if fuzz.number % 2:
        argv = ("validate", "@JOB@", "--site", "local", "--json", *fuzz.argv)
        entry = "main"
    else:
        argv = ("@JOB@", "--dry-run", "--json", "--executor", "local", "--site", "local", *fuzz.argv)
        entry = "submit"
    return Case(f"fuzz-{fuzz.number}", argv, job=fuzz.job, entry=entry, expect=(0, 2), setup=write_ds,
                check=_oracle(fuzz))


def test_every_schema_key_is_fuzzed() -> None:
    keys = schema_keys()
    assert len(keys) <= CASES, f"{CASES} cases cannot reach the {len(keys)} keys of the schema"
    touched = {(section, key) for section, key, _ in keys}
    assert ("job", "spare_nodes") in touched and ("train", "deepspeed_config") in touched and len(touched) > 90


def test_fuzz_job_files(tmp_path: Path, stub_tools: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = schema_keys()
    monkeypatch.setenv("PATH", f"{stub_tools / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}")
    monkeypatch.setenv("COLUMNS", "250")
    for name in ("HPC_TRAIN_SITE_PATH", "SLURM_JOB_ID", "SLURM_CONF"):
        monkeypatch.delenv(name, raising=False)
    failures = []
    for number in range(CASES):
        fuzz = draw_case(number, keys, SEED)
        world = make_world(tmp_path / f"case-{number}", stub_tools)
        monkeypatch.setenv("HOME", str(world.home))
        monkeypatch.setenv("TMPDIR", str(world.tmp))
        monkeypatch.setattr("tempfile.tempdir", str(world.tmp))
        try:
            run_case(_case_for(fuzz), world)
        except pytest.fail.Exception as failure:
            failures.append(f"case {number} (seed {SEED}): {str(failure)[:400]}\n  job: {fuzz.job[:300]!r}\n"
                            f"  argv: {fuzz.argv!r}\n  ds_config.json: {(fuzz.ds or '')[:200]!r}")
    assert not failures, f"{len(failures)} of {CASES} cases failed:\n" + "\n".join(failures[:10])
