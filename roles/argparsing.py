"""What every ``replica`` command shares to read its command line: errors as one line
(``replica launch: error: ...``, exit code 2, no usage dump, no traceback), the
value types its options take, each refusing a bad value with its reason, and the option
groups several commands take (deadlines, the state to resume from)."""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path

from replica.errors import ReplicaError
from replica.mirror.floor import FloorConfig
from replica.roles.timing import Deadlines
from replica.state.export import resumable

__all__ = [
    "Parser",
    "deadline_options",
    "deadlines_of",
    "durable_of_args",
    "durable_options",
    "existing_file",
    "non_negative_int",
    "port",
    "positive_float",
    "positive_int",
    "resume_point",
    "shared_domain_option",
    "start_options",
    "state_options",
    "writable_file",
]


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
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


def deadline_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--heartbeat-deadline",
        type=positive_float,
        default=Deadlines().trainer.total_seconds(),
        help="seconds without a heartbeat before a live but silent trainer is declared dead "
        "(a process that exits is declared dead at once)",
    )
    p.add_argument(
        "--standby-deadline",
        type=positive_float,
        default=None,
        help="the same for standbys (default: --heartbeat-deadline)",
    )


def durable_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--durable",
        type=Path,
        default=None,
        metavar="DIR",
        help="the durable floor: standbys write every so many committed versions to DIR (local to each "
        "standby's host, or shared), in the background; a version counts once every rank's part is "
        "written and its manifest signed; each standby keeps the newest two (docs/failover.md)",
    )
    p.add_argument(
        "--durable-every",
        type=non_negative_int,
        default=50,
        metavar="STEPS",
        help="a durable version every STEPS steps (0: by --durable-interval only)",
    )
    p.add_argument(
        "--durable-interval",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="and at least one every SECONDS (0: by --durable-every only)",
    )


def durable_of_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> FloorConfig | None:
    """``durable_options``' settings; a bad combination is a usage error."""
    if args.durable is None:
        return None
    try:
        return FloorConfig(
            directory=args.durable.resolve(),
            every_steps=args.durable_every,
            interval=timedelta(seconds=args.durable_interval),
        )
    except ValueError as exc:
        parser.error(f"--durable: {exc}")


def shared_domain_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-shared-domain",
        action="store_true",
        help="let a standby share its trainer's failure domain (its host, or REPLICA_DOMAIN): losing that "
        "domain then loses both copies of the rank. For one-machine demos and tests (also "
        "REPLICA_ALLOW_SHARED_DOMAIN=1); without it such a job is refused (exit 2)",
    )


def start_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--exec-roles",
        action="store_true",
        help="start each role as a fresh interpreter (`python SCRIPT`) instead of forking it from a server "
        "that imported torch once (seconds slower a role; for a script that sets, before importing "
        "torch, environment variables that torch reads at import)",
    )


def state_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--export-dir",
        type=Path,
        default=Path("replica-export"),
        help="where the standbys write the last commit when the job cannot go on (a rank's state lost; "
        "the job store gone), one folder per step (default: ./replica-export)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="start from an export: a folder with one file per rank (Mirror.export), or a job's export "
        "folder (its newest step of which every rank's file is there)",
    )


def resume_point(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> tuple[int, Path] | None:
    """The step and folder ``--resume`` names (None without it); a parser error if it holds no complete export."""
    if args.resume is None:
        return None
    try:
        step, folder = resumable(args.resume, world_size)
    except ReplicaError as exc:
        parser.error(f"--resume: {exc}")
    return step, folder.resolve()


def deadlines_of(args: argparse.Namespace) -> Deadlines:
    trainer = timedelta(seconds=args.heartbeat_deadline)
    return Deadlines(
        trainer=trainer, standby=timedelta(seconds=args.standby_deadline) if args.standby_deadline else trainer
    )
