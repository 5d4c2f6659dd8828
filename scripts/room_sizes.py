"""Files and lines per room of docs/architecture.md, each module put in its room by the architecture test's own
``room_of``: ``python scripts/room_sizes.py [CHECKOUT]`` (default: this one). Run it on an older checkout (``git
worktree add /tmp/old REV``) to compare layouts."""

from __future__ import annotations

import collections
import importlib.util
import sys
from pathlib import Path


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
    sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("room_rules", root / "tests" / "test_architecture.py")
    if spec is None or spec.loader is None or not (root / "hpc_train").is_dir():
        print(f"error: {root} is not an hpc_train checkout (no tests/test_architecture.py or hpc_train/); give one")
        return 2
    rules = importlib.util.module_from_spec(spec)
    sys.modules["room_rules"] = rules
    spec.loader.exec_module(rules)
    lines: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    for path in sorted((root / "hpc_train").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        room = rules.room_of(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        lines[room] += len(path.read_text(encoding="utf-8").splitlines())
        files[room] += 1
    for room in rules.ROOMS:
        print(f"{room:<14} {files[room]:>4} files {lines[room]:>7,} lines")
    print(f"{'total':<14} {sum(files.values()):>4} files {sum(lines.values()):>7,} lines; {len(rules.ROOMS)} rooms, "
          f"{sum(len(allowed) for allowed in rules.ALLOWED.values())} allowed pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
