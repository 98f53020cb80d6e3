"""``replica selftest`` as pytest cases, for a CI runner (a self-hosted GPU runner, a cluster's
own CI): one test per case of the failover matrix, each passing only when its faulted run
equals its job's failure-free reference bit for bit::

    pytest -p replica.roles.selftest_pytest --pyargs replica.roles.selftest_pytest \\
        --replica-selftest="--device cuda --trainers 1 --quick"

``--replica-selftest`` takes ``replica selftest``'s own options (the same parser: the same
checks, the same exit 2 with one line on bad input); ``-k`` selects cases as usual. A job's
baseline and reference run once, before its first case; a case this target cannot run (no
vLLM, too few trainers, no ``--durable``) is skipped with its reason. The work directory
(``--report DIR`` in the options; by default pytest's temporary folder) keeps each run's log,
job report and plots; a failed case names its log."""

from __future__ import annotations

import contextlib
import io
import shlex
import subprocess
from collections.abc import Iterator

import pytest

from replica.roles.selftest import (
    CASES,
    Case,
    JobKind,
    Plan,
    Reference,
    kill_all,
    parse,
    plan_of,
    run_case,
    run_reference,
    unavailable,
)

__all__ = ["pytest_addoption", "test_case"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("replica selftest").addoption(
        "--replica-selftest",
        default="",
        metavar="OPTIONS",
        help="`replica selftest`'s options for the matrix's pytest cases (e.g. \"--ray HOST:PORT --quick\")",
    )


class _Matrix:
    """The plan, and each job's reference made when its first case needs it."""

    def __init__(self, plan: Plan, cases: tuple[Case, ...]):
        self.plan = plan
        self.cases = {c.name for c in cases}
        self.running: list[subprocess.Popen] = []
        self._references: dict[JobKind, Reference] = {}

    def reference(self, kind: JobKind) -> Reference:
        if kind not in self._references:
            self._references[kind] = run_reference(self.plan, kind, running=self.running, say=lambda _: None)
        return self._references[kind]


@pytest.fixture(scope="session")
def _matrix(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Matrix]:
    argv = shlex.split(pytestconfig.getoption("--replica-selftest"))
    if "--report" not in argv:
        argv += ["--report", str(tmp_path_factory.mktemp("replica-selftest"))]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args, cases = parse(argv)
    except SystemExit as exc:  # argparse's one line, as `replica selftest` prints it
        why = said.getvalue().strip().splitlines()[-1] if said.getvalue().strip() else "refused"
        pytest.exit(f"--replica-selftest: {why}", returncode=int(exc.code or 2))
    matrix = _Matrix(plan_of(args), cases)
    try:
        yield matrix
    finally:
        kill_all(matrix.running)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case: Case, _matrix: _Matrix) -> None:
    """The case's faulted run equals its job's failure-free reference, its faults fired."""
    if case.name not in _matrix.cases:
        pytest.skip("not selected by the options (--quick, --case, --durable)")
    if why := unavailable(case, _matrix.plan):
        pytest.skip(why)
    reference = _matrix.reference(case.job)
    if not reference.passed:
        pytest.fail(f"the {case.job} job's reference run failed: {reference.result.why} (log: {reference.result.log})")
    result = run_case(_matrix.plan, case, reference, running=_matrix.running)
    assert result.outcome == "bit-identical", f"{case.name}: {result.outcome}: {result.why} (log: {result.log})"
