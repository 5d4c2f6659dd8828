"""Config files of hostile shape: TOML values plan.json cannot carry, nesting that exhausts the stack, Unicode
keys, NaN, and files that are not files (a FIFO, /dev/zero, a folder, 2 MB, invalid UTF-8).

Why: each of these once ended in a traceback, a hang or a plan.json that is not JSON. A file the user points the
command at is user input: exit 2 with one message, within 2 s, and nothing written (render made no run folder).
"""

from __future__ import annotations

import os
import tomllib

import pytest

from tests.security.harness import Case, World, across, cases_ids, command, on, run_case

SHAPES = [("date", "[deepspeed]\nx = 1979-05-27\n"), ("time", "[deepspeed]\nx = 07:32:00\n"),
          ("datetime", "[deepspeed]\nx = 1979-05-27T07:32:00Z\n"),
          ("local-datetime", "[deepspeed]\nx = 1979-05-27T07:32:00\n"),
          ("nested-date", "[deepspeed.a]\nb = { c = 1979-05-27 }\n"),
          ("date-in-array", "[deepspeed]\nx = [1979-05-27]\n")]
ARRAY_OF_TABLES = "[[deepspeed.foo]]\na = 1\n[[deepspeed.foo]]\na = 2\n"
DEEP_KEY = "[deepspeed]\n" + ".".join(f"k{i}" for i in range(2000)) + " = 1\n"
DEEP_ARRAY = "x = " + "[" * 100_000 + "]" * 100_000 + "\n"
DEEP_PARAMS = "[params]\nx = " + "[" * 100_000 + "]" * 100_000 + "\n"
DEEP_TABLE = "[params]\nx = " + "{a = " * 5_000 + "1" + "}" * 5_000 + "\n"
NAN = [("deepspeed-nan", "[deepspeed]\nx = nan\n", "deepspeed.x"),
       ("deepspeed-inf", "[deepspeed]\nx = inf\n", "deepspeed.x"),
       ("deepspeed-minus-inf", "[deepspeed.optimizer.params]\nlr = -inf\n", "deepspeed.optimizer.params.lr"),
       ("params-inf", "[params]\nx = inf\n", "params.x"),
       ("params-nan-in-array", "[params]\nx = [1.0, nan]\n", "params.x"),
       ("params-nested-nan", "[params.a]\nb = nan\n", "params.a.b")]


def _shape_cases() -> list[Case]:
    cases = []
    for label, toml in SHAPES:
        cases += across("validate render dry", f"deepspeed-{label}", toml, says=("deepspeed",))
    cases.append(on("render", "params-date", "[params]\nd = 1979-05-27\n", says=("params.d",)))
    for label, toml in (("deep-dotted-key", DEEP_KEY), ("deep-array", DEEP_ARRAY), ("deep-params-array", DEEP_PARAMS)):
        cases += across("validate render dry", label, toml)
    cases.append(on("render", "deep-inline-table", DEEP_TABLE))
    cases.append(on("dry", "deep-set-params", "", "--set", "params.x=" + "[" * 100_000 + "]" * 100_000))
    for label, toml, key in NAN:
        cases += across("render dry", label, toml, says=(key,))
    cases += [on("dry", "set-lr-nan", "", "--set", "train.lr=nan", says=("train.lr",)),
              on("render", "set-params-nan", "", "--set", "params.x=nan", says=("params.x",)),
              on("render", "set-deepspeed-inf", "", "--set", "deepspeed.x=inf", says=("deepspeed.x",)),
              on("render", "set-lr-minus-inf", "", "--set", "train.lr=-inf", says=("train.lr",))]
    return cases


def _round_trip(section: str):
    """Exit 0 is fine only when the written config.toml reads back to the same table."""

    def check(world: World, outcome: object) -> None:
        if getattr(outcome, "code", None) != 0:
            return
        given = tomllib.loads((world.work / "job.toml").read_text(encoding="utf-8")).get(section, {})
        written = tomllib.loads((world.run_dir / "config.toml").read_text(encoding="utf-8")).get(section, {})
        assert written == given, f"config.toml [{section}] reads back as {written!r}, not {given!r}"
    return check


def _unicode_cases() -> list[Case]:
    return [
        *across("validate render", "unicode-env-name", '[env]\n"été" = "x"\n', says=("env",)),
        *across("validate render", "unicode-deepspeed-key", '[deepspeed]\n"x²" = 1\n', says=("deepspeed",)),
        *across("validate render", "unicode-params-key", '[params]\n"été" = 1\n', says=("params",)),
        on("render", "unicode-params-fullwidth-key", '[params]\n"ｘ" = 1\n', says=("params",)),
        on("render", "unicode-params-value", '[params]\ngreeting = "été ✓ 日本 \\u00e9"\n', expect=0,
           check=_round_trip("params")),
        on("render", "unicode-env-value", '[env]\nGREETING = "grüße"\n', expect=0, check=_round_trip("env")),
        on("render", "params-key-with-space", '[params]\n"a b" = 1\n', expect=(0, 2), check=_round_trip("params")),
        on("render", "params-empty-key", '[params]\n"" = 1\n', expect=(0, 2), check=_round_trip("params")),
        on("render", "params-quote-key", '[params]\n"a\\"b" = "\\\\"\n', expect=(0, 2), check=_round_trip("params")),
        # JSON and TOML both carry an array of tables (config.toml writes it inline), so it is taken as it is.
        *across("validate dry", "deepspeed-array-of-tables", ARRAY_OF_TABLES, expect=0),
        on("render", "deepspeed-array-of-tables-render", ARRAY_OF_TABLES, expect=0, check=_round_trip("deepspeed")),
        on("render", "deepspeed-nested-ok", "[deepspeed.optimizer.params]\nweight_decay = 0.0\n", expect=(0, 2),
           check=_round_trip("deepspeed")),
    ]


def _fifo(name: str):
    def setup(world: World) -> None:
        os.mkfifo(world.work / name)
    return setup


def _write(name: str, data: bytes):
    def setup(world: World) -> None:
        (world.work / name).write_bytes(data)
    return setup


BIG = b"# padding\n" * 210_000  # 2.1 MB of comments: valid TOML, over the 1 MB cap
BAD_UTF8 = b'[job]\nname = "\xff\xfe"\n'
SITE_ARGS = ("--site", "@WORK@/site.toml")


def _file_cases() -> list[Case]:
    fifo, fifo_site = _fifo("job.toml"), _fifo("site.toml")
    return [
        on("dry", "fifo-config-dry", None, setup=fifo, isolated=True),
        on("validate", "fifo-config-validate", None, setup=fifo, isolated=True),
        on("render", "fifo-config-render", None, setup=fifo, isolated=True),
        on("render", "fifo-site-render", "", *SITE_ARGS, setup=fifo_site, isolated=True),
        on("dry", "fifo-site-dry", "", *SITE_ARGS, setup=fifo_site, isolated=True),
        command("dev-zero-config", "validate", "/dev/zero", "--site", "local", isolated=True),
        on("render", "dev-zero-site-path", "", "--site", "/dev/zero", isolated=True),
        command("dev-null-config", "validate", "/dev/null", "--site", "local", expect=(0, 2)),
        command("config-is-folder-validate", "validate", "@VICTIM@", "--site", "local"),
        command("config-is-folder-render", "render", "@VICTIM@", "--site", "local-slurm"),
        Case("config-is-folder-dry", ("@VICTIM@", "--dry-run", "--executor", "local"), job=None, entry="submit"),
        *across("validate dry", "config-2mb", None, setup=_write("job.toml", BIG)),
        *across("validate render dry", "config-invalid-utf8", None, setup=_write("job.toml", BAD_UTF8)),
        on("validate", "config-nul-byte", None, setup=_write("job.toml", b"[job]\nname = \"a\x00b\"\n")),
        on("validate", "config-bom", None, setup=_write("job.toml", b"\xef\xbb\xbf[job]\nnodes = 1\n"), expect=(0, 2)),
        *across("validate dry render stdout submit", "config-missing", None),
        on("render", "site-missing", "", "--site", "@ROOT@/nope.toml"),
        on("render", "site-is-folder", "", "--site", "@VICTIM@/"),
        on("render", "site-invalid-utf8", "", *SITE_ARGS, setup=_write("site.toml", b'name = "\xff"\n')),
        on("render", "site-2mb", "", *SITE_ARGS, setup=_write("site.toml", BIG)),
        on("render", "site-name-traversal", "", "--site", "../../../../etc/passwd"),
    ]


CASES = [*_shape_cases(), *_unicode_cases(), *_file_cases()]


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_config_shape(case: Case, world: World) -> None:
    run_case(case, world)
