"""The documentation site (mkdocs.yml over docs/) builds with `mkdocs build --strict`: a link to
a missing page or heading is a warning under mkdocs.yml's `validation`, and strict mode fails on
any warning. The README is not a page of the site, so its links into docs/ are checked against
the pages and headings the build produced."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("material", reason="mkdocs-material (the test extra) builds the docs site")

ROOT = Path(__file__).resolve().parents[2]


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(root / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _warnings(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "WARNING" in line or "ERROR" in line]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = _build(ROOT, out)
    assert proc.returncode == 0 and not _warnings(proc), (proc.stdout + proc.stderr)[-4000:]
    return out


def test_the_docs_site_builds_without_a_warning(site):
    assert (site / "index.html").is_file()
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name for p in site.glob("*/index.html")}
    assert pages - {"index"} <= built, pages - built


@pytest.mark.parametrize("link, said", [
    ("[gone](no-such-page.md)", "no-such-page.md"),
    ("[gone](runtime.md#no-such-heading)", "no-such-heading"),
    ("[gone](#no-such-heading-here)", "no-such-heading-here"),
])
def test_a_broken_link_fails_the_strict_build(tmp_path, link, said):
    """The check checks: the same site with one broken link on one page does not build."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "install.md"
    page.write_text(page.read_text(encoding="utf-8") + f"\nSee {link}.\n", encoding="utf-8")
    proc = _build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0
    assert any(said in line for line in _warnings(proc)), (proc.stdout + proc.stderr)[-4000:]


def test_the_readmes_links_reach_pages_and_headings_of_the_site(site):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#([^)\s]+))?\)", readme)
    assert links
    for path, anchor in links:
        assert (ROOT / path).is_file(), path
        stem = Path(path).stem
        html = site / ("index.html" if stem == "index" else f"{stem}/index.html")
        if anchor:
            assert f'id="{anchor}"' in html.read_text(encoding="utf-8"), f"{path}#{anchor}"
