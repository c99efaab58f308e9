"""`kvmesh native`: compile the router's request path with Cython, show what loads compiled, or
remove the build (see kvmesh.native)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from kvmesh.native import DIRECTIVES, LEFT_OUT, MANIFEST, ROOT, digest, sources, status, summary

NATIVE_HELP = "Compile the router's request path with Cython (make install runs `build`)."


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=("build", "status", "clean"),
        nargs="?",
        default="status",
        help="build: compile every module of kvmesh.router and kvmesh.protocol into an "
        "extension module beside its source; status: which load compiled now [default]; "
        "clean: remove the extension modules.",
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="Parallel compiles [default: CPUs]."
    )


def build(modules: dict[str, Path], manifest: Path, jobs: int, work: Path) -> float:
    """Compile ``modules`` and put each extension module beside its source, then write
    ``manifest`` (each source's digest); returns the seconds taken. Each file is renamed into
    place, so a process that has the old one loaded keeps it. Raises ImportError without
    Cython, and the compiler's error when a module fails (the manifest is left as it was)."""
    from Cython.Build import cythonize
    from rich.progress import Progress
    from setuptools import Distribution
    from setuptools.command.build_ext import build_ext

    t0 = time.monotonic()
    digests = {name: digest(path) for name, path in modules.items()}
    first_name, first_path = next(iter(modules.items()))
    src = first_path.parents[first_name.count(".")]  # the directory above the package
    cwd = os.getcwd()
    os.chdir(src)  # module names come from paths relative to it
    try:
        exts = cythonize(
            [str(p.relative_to(src)) for p in modules.values()],
            compiler_directives=DIRECTIVES,
            nthreads=jobs,
            build_dir=str(work / "c"),
            quiet=True,
        )
        for ext in exts:  # generated C: its warnings say nothing about kvmesh
            ext.extra_compile_args = ["-O2", "-g0", "-w"]
        with tempfile.TemporaryDirectory(dir=work) as lib, Progress() as progress:
            task = progress.add_task("compiling", total=len(exts))

            class Counted(build_ext):
                def build_extension(self, ext) -> None:
                    super().build_extension(ext)
                    progress.advance(task)

            dist = Distribution({"ext_modules": exts})
            dist.cmdclass["build_ext"] = Counted
            cmd = dist.get_command_obj("build_ext")
            cmd.parallel, cmd.build_temp, cmd.build_lib = jobs, str(work / "obj"), lib
            logging.disable(logging.INFO)  # setuptools logs each compiler command
            try:
                dist.run_command("build_ext")
            finally:
                logging.disable(logging.NOTSET)
            for ext in exts:
                built = Path(lib, cmd.get_ext_filename(ext.name))
                os.replace(built, src / cmd.get_ext_filename(ext.name))
    finally:
        os.chdir(cwd)
    manifest.write_text(json.dumps({"modules": digests}, indent=1, sort_keys=True) + "\n")
    return time.monotonic() - t0


def write_joined_profiles(path: Path) -> int:
    """Write the built-in presets' joined profile functions as a module to compile (terms.py
    finds a compiled one by the digest of its source); returns how many."""
    from types import SimpleNamespace

    from kvmesh.router.pipeline import PRESETS, Pipeline
    from kvmesh.router.plugins import terms

    ctx = SimpleNamespace(precise_index=None, approximate_index=None)
    profiles: dict = {}
    for name in PRESETS:
        for profile in Pipeline.preset(name, ctx).profiles.values():
            kinds = tuple(getattr(s, "term", None) or terms.CALL_SCORE for s, _ in profile.scorers)
            if kinds:
                profiles.update({(kinds, False): None, (kinds, True): None})
    source = terms.joined_module(list(profiles))
    if not path.exists() or path.read_text() != source:
        path.write_text(source)
    return len(profiles)


def clean(modules: dict[str, Path], manifest: Path) -> int:
    """Remove the extension modules and the manifest; returns how many modules went."""
    import importlib.machinery

    gone = 0
    for path in modules.values():
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            ext = path.with_name(path.stem + suffix)
            if ext.exists():
                ext.unlink()
                gone += 1
    manifest.unlink(missing_ok=True)
    return gone


def main(args: argparse.Namespace) -> int:
    joined = ROOT / "router" / "plugins" / "joined_profiles.py"
    if args.action == "build":
        write_joined_profiles(joined)
    modules = sources()
    if args.action == "status":
        print(summary())
        for name in status().stale:
            print(f"  edited since the build (runs as Python): {name}")
        for name, why in LEFT_OUT.items():
            print(f"  left out (runs as Python): {name}: {why}")
        return 0
    if args.action == "clean":
        print(f"removed {clean(modules, MANIFEST)} extension modules")
        joined.unlink(missing_ok=True)
        return 0
    print(f"compiling {len(modules)} modules with Cython on {args.jobs} jobs (a minute or two)")
    try:
        with tempfile.TemporaryDirectory(prefix="kvmesh-native-") as work:
            seconds = build(modules, MANIFEST, args.jobs, Path(work))
    except ImportError:
        print("Cython is not installed (pip install -e '.[native]'); kvmesh runs as Python")
        return 1
    except Exception as exc:  # a compiler's error: kvmesh still runs as Python
        print(f"the build failed ({type(exc).__name__}: {exc}); kvmesh runs as Python")
        return 1
    print(f"built {len(modules)} modules in {seconds:.0f} s; {summary()}")
    return 0
