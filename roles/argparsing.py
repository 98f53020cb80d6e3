"""What every ``replica`` command shares to read its command line: errors as one line
(``replica launch: error: ...``, exit code 2, no usage dump, no traceback), and the
value types its options take, each refusing a bad value with its reason."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["Parser", "existing_file", "non_negative_int", "port", "positive_float", "positive_int", "writable_file"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer >= 0")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: need a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: need a finite number > 0")
    return value


def port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port is in 0..65535 (0: any free one)")
    return value


def existing_file(text: str) -> str:
    """A file that must exist (a script, a report to read); given back as it was written."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return text


def writable_file(text: str) -> Path:
    """A file to write: its folder must exist (checked before the job starts, not at its end)."""
    path = Path(text)
    if not path.resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {str(path.resolve().parent)!r} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file")
    return path


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer") from None
