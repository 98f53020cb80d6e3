"""Package layout: one import name, the layer rule, explicit __all__."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"replica": ROOT / "replica", "replica.transport": ROOT / "transport", "replica.roles": ROOT / "roles",
            "replica.ray": ROOT / "rayapi"}


def test_subpackages_import_under_replica():
    import replica.roles
    import replica.transport

    assert Path(replica.transport.__file__).parent == ROOT / "transport"
    assert Path(replica.roles.__file__).parent == ROOT / "roles"


def test_build_maps_folders_into_one_package(tmp_path):
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"setup.py build_py exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    for name, folder in PACKAGES.items():
        target = tmp_path.joinpath(*name.split("."))
        assert sorted(p.name for p in target.glob("*.py")) == sorted(p.name for p in folder.glob("*.py"))


@pytest.mark.parametrize(
    "name",
    sorted(PACKAGES)
    + ["replica.ops", "replica.errors", "replica.testing", "replica.serialize", "replica.rng", "replica.layout", "replica.snapshot",
       "replica.config", "replica.backends", "replica.commit", "replica.protocol", "replica.restore", "replica.stream",
       "replica.replicator", "replica.mirror", "replica.export", "replica.resilient", "replica.registry", "replica.listener",
       "replica.weights", "replica.vllm_worker", "replica.placement", "replica.etcd", "replica.stores",
       "replica.testetcd", "replica.testcluster", "replica.jobstate",
       "replica.roles.env", "replica.roles.runtime", "replica.roles.coordinator", "replica.roles.launch",
       "replica.roles.report", "replica.roles.cli", "replica.roles.join", "replica.roles.serve",
       "replica.roles.supervise", "replica.roles.rollouts", "replica.roles.agent", "replica.roles.agents",
       "replica.roles.election", "replica.ray.actor", "replica.ray.agents", "replica.ray.job", "replica.ray.launch"]
    + [f"replica.transport.{p.stem}" for p in sorted((ROOT / "transport").glob("[!_]*.py"))],
)
def test_all_is_explicit_sorted_and_resolves(name):
    module = importlib.import_module(name)
    exported = module.__all__
    assert list(exported) == sorted(exported)
    for attr in exported:
        assert hasattr(module, attr), f"{name}.__all__ names missing {attr}"


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


def test_layers_point_down_only():
    # transport may use only the shared bottom of replica (the kernels and the errors).
    allowed_in_transport = ("replica.errors", "replica.ops", "replica._C", "replica.transport")
    bad = {n for n in _replica_imports(ROOT / "transport") if not n.startswith(allowed_in_transport)}
    assert not bad, f"transport imports higher layers: {bad}"
    bad = {n for n in _replica_imports(ROOT / "replica") if n.startswith("replica.roles")}
    assert not bad, f"replica imports roles: {bad}"
    # replica.ray (Ray actors) sits on top of roles; only the command line reaches up to it, lazily.
    bad = {n for n in _replica_imports(ROOT / "replica") | _replica_imports(ROOT / "roles", skip=("cli.py",))
           if n.startswith("replica.ray")}
    assert not bad, f"replica or roles import replica.ray: {bad}"


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
    assert not copies, (f"{_C.__file__} defines {len(copies)} std::locale symbols of its own (libstdc++ linked "
                        f"statically), e.g. {copies[0]}; rebuild with the system compiler")
