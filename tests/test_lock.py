"""The locks in requirements/ (scripts/lock.sh) match pyproject.toml, and the installers use them.

- every dependency pyproject.toml declares (runtime in runtime.txt and dev.txt, the dev extra and the build
  backend in dev.txt) is pinned with ``==`` to a version its specifier allows, where its marker holds on the
  lock's target (Linux x86_64, CPython 3.11);
- nothing is stale: every pinned package is a declared dependency or needed by one (the lock's ``# via``);
- every pin carries hashes, and a package has one version in all three files;
- grpcio is at least the version the generated stubs were made for;
- bootstrap.sh and the Dockerfile install with ``--require-hashes`` from them, and the project with ``--no-deps``.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "requirements"
PROJECT = "kubevirt-gpu-passthrough"
TARGET = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
          "python_version": "3.11", "python_full_version": "3.11.0", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix"}  # fmt: skip


@dataclass(frozen=True)
class Pin:
    name: str
    version: Version
    hashes: tuple[str, ...]
    via: tuple[str, ...]


def read_lock(path: Path) -> dict[str, Pin]:
    pins: dict[str, Pin] = {}
    blocks = re.split(r"\n(?=[A-Za-z0-9])", path.read_text())
    for block in blocks:
        if block.startswith("#") or not block.strip():
            continue
        head = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", block)
        assert head, f"{path.name}: not a pinned requirement: {block.splitlines()[0]!r}"
        via = re.search(r"# via (.*)", block)
        assert via, f"{path.name}: {head.group(1)} has no '# via' annotation"
        name = canonicalize_name(head.group(1))
        pins[name] = Pin(
            name,
            Version(head.group(2)),
            tuple(re.findall(r"--hash=sha256:([0-9a-f]{64})", block)),
            tuple(part.strip() for part in via.group(1).split(",")),
        )
    return pins


def declared() -> tuple[list[Requirement], list[Requirement], list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = [Requirement(text) for text in project["dependencies"]]
    dev = [Requirement(text) for text in project["optional-dependencies"]["dev"]]
    build = [
        Requirement(line)
        for line in (LOCKS / "build.in").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return runtime, dev, build


def applies(requirement: Requirement) -> bool:
    return requirement.marker is None or requirement.marker.evaluate(TARGET)


def check_declared(pins: dict[str, Pin], requirements: list[Requirement], lock: str) -> list[str]:
    problems = []
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if not applies(requirement):
            continue
        if name not in pins:
            problems.append(f"{lock}: {requirement} is declared but not locked (run scripts/lock.sh)")
        elif not requirement.specifier.contains(pins[name].version, prereleases=True):
            problems.append(f"{lock}: {name}=={pins[name].version} does not satisfy {requirement}")
    return problems


def check_stale(pins: dict[str, Pin], roots: set[str], lock: str) -> list[str]:
    """Every pin reachable from the declared roots through the '# via' graph."""
    needed_by: dict[str, set[str]] = {name: set() for name in pins}
    for pin in pins.values():
        for source in pin.via:
            if source.startswith("-c ") or source.startswith("-r "):
                continue
            parent = canonicalize_name(source.split(" (")[0])
            if parent in needed_by:
                needed_by[parent].add(pin.name)
    reached = set()
    todo = [name for name in roots if name in pins]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(needed_by[name])
    return [f"{lock}: {name} is locked but nothing declared needs it (run scripts/lock.sh)" for name in
            sorted(set(pins) - reached)]  # fmt: skip


@pytest.fixture(scope="module")
def locks() -> dict[str, dict[str, Pin]]:
    return {name: read_lock(LOCKS / f"{name}.txt") for name in ("runtime", "dev", "build")}


def test_every_declared_dependency_is_locked_within_its_specifier(locks: dict[str, dict[str, Pin]]) -> None:
    runtime, dev, build = declared()
    problems = check_declared(locks["runtime"], runtime, "runtime.txt")
    problems += check_declared(locks["dev"], runtime + dev + build, "dev.txt")
    problems += check_declared(locks["build"], build, "build.txt")
    assert not problems, "\n".join(problems)


def names(requirements: list[Requirement]) -> set[str]:
    return {str(canonicalize_name(r.name)) for r in requirements if applies(r)}


def test_nothing_stale_is_locked(locks: dict[str, dict[str, Pin]]) -> None:
    runtime, dev, build = declared()
    problems = check_stale(locks["runtime"], names(runtime), "runtime.txt")
    problems += check_stale(locks["dev"], names(runtime + dev + build), "dev.txt")
    problems += check_stale(locks["build"], names(build), "build.txt")
    assert not problems, "\n".join(problems)


def test_every_pin_is_hashed_and_has_one_version_everywhere(locks: dict[str, dict[str, Pin]]) -> None:
    seen: dict[str, Version] = {}
    for lock, pins in locks.items():
        for pin in pins.values():
            assert pin.hashes, f"{lock}.txt: {pin.name} has no --hash"
            assert seen.setdefault(pin.name, pin.version) == pin.version, f"{pin.name}: two versions in the locks"
    # libvirt-python has no wheels: its sdist's hash is what pip checks before building it
    assert len(locks["dev"]["libvirt-python"].hashes) >= 1


def test_the_stale_and_missing_checks_catch_what_they_should() -> None:
    pins = {
        "a": Pin("a", Version("1.0"), ("0" * 64,), (f"{PROJECT} (pyproject.toml)",)),
        "b": Pin("b", Version("2.0"), ("1" * 64,), ("a",)),
        "old": Pin("old", Version("1.0"), ("2" * 64,), ("gone",)),
    }
    assert check_stale(pins, {"a"}, "x") == ["x: old is locked but nothing declared needs it (run scripts/lock.sh)"]
    wanted = [Requirement("a>=1.5"), Requirement("c"), Requirement("d; sys_platform=='win32'")]
    problems = check_declared(pins, wanted, "x")
    assert problems == [
        "x: a==1.0 does not satisfy a>=1.5",
        "x: c is declared but not locked (run scripts/lock.sh)",
    ]


def test_grpcio_is_at_least_what_the_generated_stubs_need(locks: dict[str, dict[str, Pin]]) -> None:
    stubs = "\n".join(path.read_text() for path in (ROOT / "schemas" / "generated").rglob("*_pb2_grpc.py"))
    (wanted,) = set(re.findall(r"GRPC_GENERATED_VERSION = '([^']+)'", stubs))
    for lock in ("runtime", "dev"):
        assert locks[lock]["grpcio"].version >= Version(wanted)
    assert locks["dev"]["grpcio-tools"].version == Version(wanted)


def test_the_installers_use_the_locks_with_hashes() -> None:
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert "install --require-hashes -r requirements/build.txt" in bootstrap
    assert 'install --require-hashes --no-build-isolation -r "$lock"' in bootstrap
    assert "install --no-deps --no-build-isolation -e ." in bootstrap
    assert "stamp() { cat pyproject.toml requirements/build.txt" in bootstrap  # reinstall when a lock changes
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "--require-hashes -r requirements/build.txt -r requirements/runtime.txt" in dockerfile
    assert "install --no-deps dist/" in dockerfile
