"""A failure's traceback starts at the user's own code: hpc_train's and runpy's frames before it are left out and
counted; frames after it (ours the user's code called) and a traceback with no user frame stay whole."""

from __future__ import annotations

import runpy
from pathlib import Path

import hpc_train
from hpc_train.rank.program.tracebacks import user_traceback

OURS = str(Path(hpc_train.__file__).resolve().parent / "rank" / "program" / "runner_like.py")


def _ours(source: str) -> dict[str, object]:
    """Functions whose frames carry a file name inside the hpc_train package, as the runner's do."""
    namespace: dict[str, object] = {}
    exec(compile(source, OURS, "exec"), namespace)  # noqa: S102 - the test's own code
    return namespace


def _raised(call: object) -> BaseException:
    """What ``call`` raised, its traceback starting at the first frame of ours (as a rank's starts in entry)."""
    try:
        call()  # type: ignore[operator]
    except Exception as error:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != OURS:
            tb = tb.tb_next
        return error.with_traceback(tb)
    raise AssertionError("nothing was raised")


def test_our_frames_before_the_user_function_are_left_out_and_counted() -> None:
    ours = _ours("def entry(f):\n    return run(f)\ndef run(f):\n    return f()\n")

    def users_function() -> None:
        raise ValueError("bad shard 7")

    text = user_traceback(_raised(lambda: ours["entry"](users_function)))
    lines = text.splitlines()
    assert lines[0] == "(2 frames of hpc_train and runpy before your code left out)"
    assert lines[1] == "Traceback (most recent call last):" and "in users_function" in lines[2]
    assert OURS not in text and lines[-1] == "ValueError: bad shard 7"


def test_our_frames_the_user_code_called_into_stay() -> None:
    ours = _ours("def entry(f):\n    return f()\ndef check(x):\n    raise KeyError(x)\n")
    text = user_traceback(_raised(lambda: ours["entry"](lambda: ours["check"]("k"))))
    assert text.startswith("(1 frame of hpc_train and runpy before your code left out)\n")
    assert text.count(OURS) == 1 and "in check" in text  # the frame of ours the user's code called


def test_a_traceback_without_a_user_frame_stays_whole() -> None:
    ours = _ours("def entry():\n    return run()\ndef run():\n    raise RuntimeError('ours')\n")
    text = user_traceback(_raised(lambda: ours["entry"]()))
    assert text.startswith("Traceback (most recent call last):") and text.count(OURS) == 2


def test_runpy_frames_of_a_script_are_left_out(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("def f():\n    raise ZeroDivisionError('z')\nf()\n")
    ours = _ours("def entry(run, path):\n    return run(path)\n")
    text = user_traceback(_raised(lambda: ours["entry"](runpy.run_path, str(script))))
    first = next(line for line in text.splitlines() if line.strip().startswith("File "))
    assert str(script) in first and "<frozen runpy>" not in text and "run_path" not in text
    assert text.startswith("(4 frames of hpc_train and runpy before your code left out)")


def test_a_failure_reached_through_a_library_first_keeps_every_frame() -> None:
    """Before the user's function runs (the process group, torch's own code) or in the trainer through torch, the
    first frame below ours is Python's library or an installed package's: nothing is left out."""
    ours = _ours("import json\ndef entry(hook):\n    return json.loads('{}', object_hook=hook)\n")

    def hook(_value: object) -> None:
        raise RuntimeError("from below the library")

    text = user_traceback(_raised(lambda: ours["entry"](hook)))
    assert text.startswith("Traceback (most recent call last):") and OURS in text and "json" in text
