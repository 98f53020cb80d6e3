"""Package layout: one import name, the layer rule, explicit __all__."""

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Folders of the checkout -> the installed package they become (setup.py's PACKAGE_DIR).
FOLDERS = {
    "replica": ROOT / "replica",
    "replica.transport": ROOT / "transport",
    "replica.roles": ROOT / "roles",
    "replica.ray": ROOT / "rayapi",
}
# Subpackages of replica/ by concern.
SUBPACKAGES = ("distributed", "integrations", "integrations/vllm", "jobstore", "mirror", "session", "state", "weights")
PACKAGES = FOLDERS | {f"replica.{sub.replace('/', '.')}": ROOT / "replica" / sub for sub in SUBPACKAGES}
# Scripts shipped in the wheel, not modules to import (`replica selftest` runs them).
SCRIPTS = {"replica.examples": ROOT / "examples"}


def _modules() -> list[str]:
    """Every module of the package (vLLM's are imported where vLLM is: their own tests)."""
    names = []
    for package, folder in PACKAGES.items():
        names += [package] + [f"{package}.{p.stem}" for p in sorted(folder.glob("[!_]*.py"))]
    return sorted(n for n in names if not n.startswith("replica.integrations.vllm."))


def test_subpackages_import_under_replica():
    import replica.roles
    import replica.transport

    assert Path(replica.transport.__file__).parent == ROOT / "transport"
    assert Path(replica.roles.__file__).parent == ROOT / "roles"


def test_build_maps_folders_into_one_package(tmp_path):
    done = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (
        f"setup.py build_py exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    for name, folder in (PACKAGES | SCRIPTS).items():
        target = tmp_path.joinpath(*name.split("."))
        assert sorted(p.name for p in target.glob("*.py")) == sorted(p.name for p in folder.glob("*.py"))
    assert [p.name for p in tmp_path.iterdir()] == ["replica"], "only replica ships (not tests/support)"
    shipped = {p.parent for p in (tmp_path / "replica").rglob("*.py")}
    assert shipped == {tmp_path.joinpath(*name.split(".")) for name in PACKAGES | SCRIPTS}, (
        "a folder of replica/ left out of the wheel"
    )


@pytest.mark.parametrize("name", _modules())
def test_all_is_explicit_sorted_and_resolves(name):
    module = importlib.import_module(name)
    exported = module.__all__
    assert list(exported) == sorted(exported)
    for attr in exported:
        assert hasattr(module, attr), f"{name}.__all__ names missing {attr}"


def test_top_level_all_names_the_errors_and_the_lazy_names():
    """replica/__init__.py spells its lazy names out in __all__ (for type checkers): none missing, none extra."""
    import replica
    from replica import errors

    assert set(replica.__all__) == {*errors.__all__, *replica._LAZY, "__version__"}


# replica 0.1's flat module paths, removed before any release: none may come back, as a
# module or as an alias (each names where its module lives now, e.g. replica.jobstore).
OLD_PATHS = (
    "replica.backends",
    "replica.bucketstream",
    "replica.commit",
    "replica.data",
    "replica.divergence",
    "replica.etcd",
    "replica.etcdwatch",
    "replica.export",
    "replica.jobstate",
    "replica.layout",
    "replica.listener",
    "replica.pagebuffer",
    "replica.placement",
    "replica.protocol",
    "replica.registry",
    "replica.repair",
    "replica.replicator",
    "replica.resilient",
    "replica.restore",
    "replica.rng",
    "replica.serialize",
    "replica.snapshot",
    "replica.stores",
    "replica.stream",
    "replica.vllm_plugin",
    "replica.vllm_staging",
    "replica.vllm_transfer",
    "replica.vllm_worker",
)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_old_module_paths_do_not_import(old):
    """replica 0.1's flat module paths are gone: no module, no alias of a new home."""
    assert importlib.util.find_spec(old) is None, f"{old} imports again: use its new path"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_public_paths_in_a_fresh_interpreter():
    """The names users have: replica.Replicator, Mirror, Config, replica.roles.init, and the
    vLLM module paths (a vLLM configured with them), each in an interpreter of its own."""
    code = (
        "import replica; from replica import Config, Mirror, Replicator\n"
        "from replica.integrations.vllm.transfer import ReplicaWeightTransferEngine\n"
        "from replica.integrations.vllm.plugin import register\n"
        "from replica.mirror import Mirror as M, fetch_mirror\n"
        "from replica.jobstore import JobStore, keys\n"
        "import replica.roles; assert callable(replica.roles.init) and M is Mirror\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


#: What the data plane never needs: the mirror, the training loop's collectives, FSDP, vLLM.
HEAVY = (
    "replica.mirror",
    "replica.distributed",
    "replica.weights",
    "replica.state",
    "replica.integrations",
    "replica.roles",
    "torch.distributed.fsdp",
    "vllm",
)


@pytest.mark.parametrize("module", ["replica", "replica.errors", "replica.transport"])
def test_importing_a_layer_loads_nothing_above_it(module):
    """The top-level names are imported on first use: the bottom layer's independence holds at
    run time, not only in the source."""
    code = f"import sys, {module}\nprint('\\n'.join(m for m in sys.modules if m.startswith({HEAVY!r})))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == [], done.stdout
    import replica  # and each name still resolves, once, to its definition

    assert replica.Mirror is importlib.import_module("replica.mirror.standby").Mirror
    assert replica.ops is importlib.import_module("replica.ops")
    with pytest.raises(AttributeError, match="no attribute 'Mirorr'"):
        replica.Mirorr  # noqa: B018


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from replica import ops` uses replica.ops, not all of replica
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _replica_imports(folder: Path, skip: tuple[str, ...] = ()) -> set[str]:
    found = set()
    for path in folder.rglob("*.py"):
        if path.name in skip:
            continue
        found.update(n for n in _imports(path) if n == "replica" or n.startswith("replica."))
    return found


# The shared bottom every layer may use: the typed errors, the kernels, time and names.
BOTTOM = ("replica.errors", "replica.ops", "replica._C", "replica.timing", "replica.envvars")
_SESSION = BOTTOM + ("replica.config", "replica.transport", "replica.state", "replica.jobstore", "replica.session")
# replica/<subpackage> -> what it may import. State and transport know nothing of the job
# store or the roles; the job store knows nothing of the state, the sessions or transport.
LAYERS = {
    "state": BOTTOM + ("replica.transport", "replica.state"),
    "jobstore": BOTTOM + ("replica.jobstore",),
    "distributed": BOTTOM + ("replica.distributed",),
    "session": _SESSION,
    "mirror": _SESSION + ("replica.distributed", "replica.mirror"),
    "weights": _SESSION + ("replica.weights",),
    "integrations": _SESSION + ("replica.weights", "replica.integrations"),
}


def _outside(imports: set[str], allowed: tuple[str, ...]) -> set[str]:
    return {n for n in imports if not any(n == a or n.startswith(a + ".") for a in allowed)}


def test_layers_point_down_only():
    # transport may use only the shared bottom of replica.
    bad = _outside(_replica_imports(ROOT / "transport"), BOTTOM + ("replica.transport",))
    assert not bad, f"transport imports higher layers: {bad}"
    bad = {n for n in _replica_imports(ROOT / "replica") if n.startswith("replica.roles")}
    assert not bad, f"replica imports roles: {bad}"
    # replica.ray (Ray actors) sits on top of roles; only the command line reaches up to it, lazily.
    bad = {
        n
        for n in _replica_imports(ROOT / "replica") | _replica_imports(ROOT / "roles", skip=("cli.py",))
        if n.startswith("replica.ray")
    }
    assert not bad, f"replica or roles import replica.ray: {bad}"
    for sub, allowed in LAYERS.items():
        bad = _outside(_replica_imports(ROOT / "replica" / sub), allowed)
        assert not bad, f"replica/{sub} imports what its layer may not: {bad}"
    # Nothing shipped imports the tests' helpers (tests/support, or a module of tests/); nothing
    # in the tree imports an old module path.
    tests = {"support", *(p.stem for p in (ROOT / "tests").glob("*.py"))}
    for folder in FOLDERS.values():
        for path in folder.rglob("*.py"):
            helpers = {n for n in _imports(path) if n.split(".")[0] in tests}
            assert not helpers, f"{path} imports the tests' helpers {helpers}"
            names = {n for n in _imports(path) if n.startswith("replica.")}
            old = {n for n in names if any(n == o or n.startswith(o + ".") for o in OLD_PATHS)}
            assert not old, f"{path} imports old module paths {old} (removed: use the new ones)"


def test_layer_check_sees_imports(tmp_path):
    # The rule above must be able to fail: it parses real import statements.
    (tmp_path / "m.py").write_text("import replica.roles\nfrom replica.roles import x\n")
    assert {"replica.roles", "replica.roles.x"} <= _replica_imports(tmp_path)
    (tmp_path / "m.py").write_text("from replica import roles\n")
    assert _replica_imports(tmp_path) == {"replica.roles"}


def test_extension_does_not_carry_its_own_libstdcxx():
    """A _C linked with a static copy of libstdc++ (one GPU image's compiler wrapper built it so)
    holds a second copy of the locale machinery, and its error messages segfault when they
    format a number (seen on an H100). Build with the system compiler (CXX=/usr/bin/g++)."""
    from replica import _C

    nm = subprocess.run(["nm", "-C", "--defined-only", _C.__file__], capture_output=True, text=True)
    if nm.returncode != 0:
        pytest.skip(f"nm cannot read the extension: {nm.stderr.strip()}")
    copies = [line for line in nm.stdout.splitlines() if "std::locale::" in line]
    assert not copies, (
        f"{_C.__file__} defines {len(copies)} std::locale symbols of its own (libstdc++ linked "
        f"statically), e.g. {copies[0]}; rebuild with the system compiler"
    )


def _calls_monotonic_plus(path: Path) -> list[int]:
    """Lines of ``time.monotonic() + ...``: a deadline written by hand instead of ``replica.timing.Deadline``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = node.left
            if (
                isinstance(left, ast.Call)
                and isinstance(left.func, ast.Attribute)
                and left.func.attr == "monotonic"
                and isinstance(left.func.value, ast.Name)
                and left.func.value.id == "time"
            ):
                found.append(node.lineno)
    return found


def test_deadlines_are_written_one_way(tmp_path):
    """Every deadline is a ``replica.timing.Deadline``: no ``time.monotonic() +`` outside that module."""
    folders = [*FOLDERS.values(), ROOT / "bench", ROOT / "tests", ROOT / "examples", ROOT / "tools"]
    hand = {
        f"{p.relative_to(ROOT)}:{line}"
        for folder in folders
        for p in folder.rglob("*.py")
        if p != ROOT / "replica" / "timing.py"
        for line in _calls_monotonic_plus(p)
    }
    assert not hand, f"deadlines written by hand (use replica.timing.Deadline): {sorted(hand)}"
    (tmp_path / "m.py").write_text("import time\nend = time.monotonic() + 5\n")
    assert _calls_monotonic_plus(tmp_path / "m.py") == [2]  # the check can fail


def _env_names_spelled_out(path: Path) -> list[str]:
    """Where ``path`` spells out a replica environment variable instead of naming it from
    ``replica.envvars``: a string (an f-string's text parts too) or a keyword argument
    (``dict(REPLICA_X=...)``) that starts with ``REPLICA_``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("REPLICA_"):
            found.append(f"{path}:{node.lineno}: {node.value[:40]!r}")
        elif isinstance(node, ast.keyword) and node.arg is not None and node.arg.startswith("REPLICA_"):
            found.append(f"{path}:{node.value.lineno}: {node.arg}=")
    return found


def test_environment_variables_are_named_in_one_module():
    """Every REPLICA_* variable is a constant of replica/envvars.py, which writers and readers
    both import: nothing shipped, no example and no benchmark spells one out."""
    names = ROOT / "replica" / "envvars.py"
    found = [
        hit
        for folder in (*FOLDERS.values(), ROOT / "examples", ROOT / "bench")
        for path in sorted(folder.rglob("*.py"))
        if path != names
        for hit in _env_names_spelled_out(path)
    ]
    assert not found, "environment variables spelled out (use replica.envvars):\n" + "\n".join(found)
    from replica import envvars

    values = [getattr(envvars, n) for n in envvars.__all__]
    assert len(values) == len(set(values)), "two constants of replica.envvars name one variable"


def test_environment_name_check_sees_literals(tmp_path):
    # The rule above must be able to fail: a plain string, an f-string's text and a keyword.
    (tmp_path / "m.py").write_text(
        'import os\nos.environ.get("REPLICA_TOKEN")\nx = f"REPLICA_STEPS={1}"\n'
        'dict(REPLICA_ROLE="trainer")\n"""Prose may name REPLICA_TOKEN."""\n'
        'y = "set REPLICA_TOKEN"\n'
    )
    found = _env_names_spelled_out(tmp_path / "m.py")
    assert sorted(int(hit.split(": ", 1)[0].rsplit(":", 1)[1]) for hit in found) == [2, 3, 4], found
