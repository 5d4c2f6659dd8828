"""Terminal escapes and rich markup in config input: control characters are refused, markup is shown as text.

Why: the plan summary prints job and [env] values through rich, which would read ``[/]`` as a closing tag (a crash)
and ``[link=...]`` as a hyperlink; an ESC or C1 CSI byte in a key or value would retitle or clear the terminal of
whoever runs validate, and a bidi override (U+202E) makes a value read differently from what runs. Config input
holding a control character is refused (exit 2) and the refusal itself shows it escaped; accepted markup appears
literally in the dry-run output.
"""

from __future__ import annotations

import pytest

from tests.security.harness import Case, World, across, cases_ids, on, q, run_case, site_toml

CONTROLS = [("esc-title", "x\x1b]0;pwned\x07"), ("esc-clear", "x\x1b[2J"), ("csi", "x\x9b2J"), ("bidi", "ab\u202ecd"),
            ("nel", "x\x85y")]
WHERE = [("job-name", "[job]\nname = {v}\n", "job.name"), ("env-value", "[env]\nFOO = {v}\n", "env.FOO"),
         ("env-name", "[env]\n{v} = \"x\"\n", "env"), ("params-key", "[params]\n{v} = 1\n", "params"),
         ("args", "[job]\nargs = [{v}]\n", "job.args"), ("deepspeed-key", "[deepspeed]\n{v} = 1\n", "deepspeed"),
         ("partition", "[job]\npartition = {v}\n", "job.partition"), ("forward-env", "[job]\nforward_env = [{v}]\n",
                                                                     "job.forward_env")]


def _control_cases() -> list[Case]:
    cases = []
    for where, toml, key in WHERE:
        for label, value in CONTROLS:
            text = toml.format(v=q(value))
            commands = "dry validate" if label == "esc-title" else "dry"
            cases += across(commands, f"{where}-{label}", text, says=(key,), no_escapes=True)
    cases += [
        on("dry", "set-env-esc", "", "--set", "env.FOO=\x1b]0;pwned\x07", says=("env.FOO",), no_escapes=True),
        on("dry", "set-name-csi", "", "--set", "job.name=a\x9bb", says=("job.name",), no_escapes=True),
        on("dry", "sweep-value-esc", "", "--sweep", "train.model=tiny,\x1b[2J", no_escapes=True),
        on("dry", "env-value-u2028", "[env]\nFOO = \"a\\u2028b\"\n", expect=(0, 2), no_escapes=True),
        on("render", "params-value-esc", "[params]\ns = \"\\u001b[2J\"\n", expect=(0, 2), no_escapes=True),
        on("render", "deepspeed-value-esc", "[deepspeed]\ns = \"\\u001b]0;t\\u0007\"\n", expect=(0, 2),
           no_escapes=True),
        on("dry", "site-description-esc", "", site=site_toml({"description": q("\x1b]0;pwned\x07")}),
           expect=(0, 2), no_escapes=True),
        on("dry", "site-name-esc", "", site=site_toml({"name": q("x\x1b[2J")}), says=("name",), no_escapes=True),
        on("dry", "site-env-value-esc", "", site=site_toml({"env.FOO": q("\x1b[2J")}), says=("FOO",), no_escapes=True),
    ]
    return cases


MARKUP = [("close-all", "[/]"), ("link", "[link=http://evil]x[/link]"), ("open-bold", "[bold]x"),
          ("close-bold", "[/bold]"), ("escaped", "\\[bold]x"), ("emoji", ":pile_of_poo:"), ("style", "[red on white]x")]


def _markup_cases() -> list[Case]:
    cases = []
    for label, value in MARKUP:
        cases += across("dry validate", f"env-markup-{label}", f"[env]\nFOO = {q(value)}\n", expect=0, shows=(value,))
        cases.append(on("dry", f"args-markup-{label}", f"[job]\nargs = [{q(value)}]\n", expect=0, shows=(value,)))
    cases += [
        on("dry", "exclude-brackets-shown", '[job]\nexclude = "n[1-2]"\n', expect=0, shows=("n[1-2]",)),
        on("dry", "constraint-brackets-shown", '[job]\nconstraint = "[rack1|rack2]"\n', expect=0,
           shows=("[rack1|rack2]",)),
        on("dry", "code-folder-markup", None, expect=0, setup=_markup_folder, shows=("[bold]",)),
        on("dry", "sweep-markup-value", "", "--sweep", "params.tag=[/],[bold]x", expect=0, shows=("[/]", "[bold]x")),
    ]
    return cases


def _markup_folder(world: World) -> None:
    """The job file and its program in a folder named like markup: the summary shows the code folder."""
    folder = world.work / "[bold]"
    folder.mkdir()
    (folder / "prog.py").write_text("print('hi')\n", encoding="utf-8")
    (world.work / "job.toml").write_text(f'[job]\nrun_root = "{world.runs}"\nprogram = "[bold]/prog.py"\n',
                                         encoding="utf-8")


CASES = [*_control_cases(), *_markup_cases()]


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_terminal_escapes(case: Case, world: World) -> None:
    run_case(case, world)
