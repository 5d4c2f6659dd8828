"""The corpus stays a corpus: at least 250 hostile cases, each id unique, every login-node command covered.

Why: the cases are spread over several modules by theme; a refactor that drops a module's list (or an id clash
that makes pytest run one case twice) would shrink the net without any test failing.
"""

from __future__ import annotations

from collections import Counter

from tests.security import (
    test_ckpt,
    test_cli_input,
    test_config_shape,
    test_directives,
    test_env,
    test_escapes,
    test_run_folder,
    test_run_root,
)

MODULES = (test_ckpt, test_cli_input, test_config_shape, test_directives, test_env, test_escapes, test_run_folder,
           test_run_root)
ALL = [case for module in MODULES for case in module.CASES]


def test_at_least_250_cases_with_unique_ids() -> None:
    assert len(ALL) >= 250, f"only {len(ALL)} hostile cases"
    clashes = [name for name, count in Counter(case.id for case in ALL).items() if count > 1]
    assert not clashes, f"ids used twice: {clashes}"


def test_every_login_node_command_is_fed_hostile_input() -> None:
    commands = Counter()
    for case in ALL:
        if case.entry == "submit":
            commands["submit --dry-run" if "--dry-run" in case.argv else "submit"] += 1
        else:
            first = case.argv[0]
            commands[f"{first} {case.argv[1]}" if first == "ckpt" else first] += 1
        commands["render --stdout"] += "--stdout" in case.argv
    for name in ("submit --dry-run", "submit", "validate", "render", "render --stdout", "ckpt ls", "ckpt verify",
                 "ckpt export", "status", "logs"):
        assert commands[name] >= 5, f"{name}: only {commands[name]} cases"
