"""The manual stays true to the code: the generated CLI and plugin references are what the
generator writes from today's parsers and registry, every README link into docs/ lands on a file
(and a heading, when it names one), and the site builds with `mkdocs build --strict`."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _slug(heading: str) -> str:
    """A heading's anchor as MkDocs' toc extension makes it (ASCII headings)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[\s-]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)}


def test_generated_references_match_the_code() -> None:
    gen = _gen_docs()
    stale = [str(p.relative_to(ROOT)) for p in gen.stale()]
    assert not stale, f"{stale} differ from the code: run python scripts/gen_docs.py"


def test_plugin_reference_lists_every_registered_plugin() -> None:
    from kvmesh.router.plugins.registry import REGISTRY

    page = (DOCS / "routing" / "plugins.md").read_text(encoding="utf-8")
    missing = [name for name in REGISTRY if f"### `{name}`" not in page]
    assert not missing


def test_readme_links_into_docs_land() -> None:
    links = [t for t in LINK.findall(README.read_text(encoding="utf-8")) if t.startswith("docs/")]
    assert links, "the README links into the manual"
    broken = []
    for target in links:
        path, _, anchor = target.partition("#")
        page = ROOT / path
        missing_anchor = bool(anchor) and page.suffix == ".md" and anchor not in _anchors(page)
        if not page.is_file() or missing_anchor:
            broken.append(target)
    assert not broken, f"README links to missing docs: {broken}"


def test_readme_is_a_front_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert "make serve" in text and "make test" in text


def test_slug_matches_mkdocs_headings() -> None:
    assert _slug("What `kvmesh up` does") == "what-kvmesh-up-does"
    assert _slug("Tiered KV cache and peer sharing") == "tiered-kv-cache-and-peer-sharing"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')",
)
def test_manual_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "index.html").is_file()
