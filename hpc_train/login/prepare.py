"""``python -m hpc_train.login.prepare TEXT_FILE OUT_FILE``: text to a byte-level uint16 token file.

Runs on a login node, so it imports only the standard library (no numpy, no torch). Each byte of the text is one
token (vocab 256), stored as little-endian uint16 — the format :class:`hpc_train.rank.train.data.TokenFile` maps.
The output appears atomically (temp file, fsync, rename; mode 0600): a crash or a bad input never leaves a
partial token file behind, and an existing OUT_FILE is replaced only by a complete one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO

from hpc_train.errors import ConfigError

__all__ = ["main", "prepare_text"]

EXIT_FAILURE = 1
EXIT_USAGE = 2
_CHUNK = 1 << 20


def _check_paths(text_path: Path, out_path: Path) -> None:
    """Refuse bad input before anything is written."""
    if not text_path.is_file():
        what = "is a folder" if text_path.is_dir() else "no such file"
        raise ConfigError(str(text_path), what, "give an existing text file")
    try:
        with text_path.open("rb"):
            pass
    except OSError as error:
        raise ConfigError(str(text_path), f"cannot read it: {error.strerror}", "check its permissions") from None
    if text_path.stat().st_size == 0:
        raise ConfigError(str(text_path), "is empty, so there are no tokens", "give a text file with some content")
    if not out_path.parent.is_dir():
        raise ConfigError(str(out_path), f"folder {out_path.parent} does not exist", "create it first")
    if out_path.is_dir():
        raise ConfigError(str(out_path), "is a folder", "give a file name, like corpus.u16")
    if out_path.exists() and out_path.resolve() == text_path.resolve():
        raise ConfigError(str(out_path), "is the input text file", "write the tokens to another file")


def _write_tokens(text: Path, sink: BinaryIO) -> int:
    """Stream ``text`` into ``sink`` as little-endian uint16, one token per byte, fsynced; returns the count."""
    count = 0
    with text.open("rb") as source:
        while chunk := source.read(_CHUNK):
            tokens = bytearray(2 * len(chunk))
            tokens[0::2] = chunk  # little-endian uint16: low byte the token, high byte zero
            sink.write(tokens)
            count += len(chunk)
    sink.flush()
    os.fsync(sink.fileno())
    return count


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable (best effort: some file systems refuse to open folders)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare_text(text_path: str | os.PathLike[str], out_path: str | os.PathLike[str]) -> int:
    """Write ``text_path``'s bytes as a uint16 token file at ``out_path``, atomically; returns the token count.

    Raises :class:`~hpc_train.errors.ConfigError` (a ValueError) for bad input; nothing is written then.
    """
    text, out = Path(text_path), Path(out_path)
    _check_paths(text, out)
    try:
        fd, temp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as error:
        raise ConfigError(str(out), f"cannot write in {out.parent}: {error.strerror}",
                          "choose a writable folder") from None
    try:
        with os.fdopen(fd, "wb") as sink:
            os.fchmod(sink.fileno(), 0o600)
            count = _write_tokens(text, sink)
        if count == 0:
            raise ConfigError(str(text), "is empty, so there are no tokens", "give a text file with some content")
        os.replace(temp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    _fsync_folder(out.parent)
    return count


def main(argv: list[str] | None = None) -> int:
    """Command line: exit 0 done, 1 an I/O failure while writing, 2 bad input (one ``error:`` line)."""
    parser = argparse.ArgumentParser(prog="python -m hpc_train.login.prepare",
                                     description="Write a text file as a byte-level uint16 token file.")
    parser.add_argument("text_file", type=Path, help="text to tokenize, one token per byte")
    parser.add_argument("out_file", type=Path, help="token file to write (uint16, vocab 256)")
    args = parser.parse_args(argv)
    try:
        count = prepare_text(args.text_file, args.out_file)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:
        print(f"error: {error.filename or args.out_file}: {error.strerror or error}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"wrote {count} tokens to {args.out_file} (byte-level, vocab 256, uint16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
