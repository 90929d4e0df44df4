"""The documentation site: its generated pages match the code, it builds with `mkdocs build --strict`
(no broken link or anchor, no page left out of the nav), and the README stays a short entry into it."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from podtrain import docs_gen

REGENERATE = "run `python -m podtrain.docs_gen` and commit docs/reference/"


def test_the_generated_reference_pages_are_those_the_code_gives(repo, tmp_path):
    written = docs_gen.write(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == ["reference/cli.md", "reference/config.md"]
    for path in written:
        rel = path.relative_to(tmp_path)
        committed = repo / "docs" / rel
        assert committed.is_file() and committed.read_text() == path.read_text(), \
            f"docs/{rel} is stale: {REGENERATE}"


def test_the_cli_reference_lists_every_command_and_flag():
    page = docs_gen.cli_page()
    for path in docs_gen.cli.COMMANDS:
        assert f"\n## podtrain {' '.join(path)}\n" in page
    # flags of several modules, with their defaults and help; hidden (SUPPRESS) flags stay out
    assert "| `--nproc NPROC` |" in page and "| `--max-run MAX_RUN` | `16` |" in page
    assert "| `--kind {pytorchjob,hyperpodpytorchjob}` | `pytorchjob` |" in page
    assert "--request-gpus" not in page and "| `--hyperpod` |" not in page


def nav_pages(nav) -> list[str]:
    """Every page file a MkDocs ``nav`` names, depth first."""
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_and_strict_validation_is_on(repo):
    config = yaml.safe_load((repo / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    on_disk = sorted(p.relative_to(repo / "docs").as_posix() for p in (repo / "docs").rglob("*.md"))
    assert sorted(pages) == on_disk
    # strict turns each of these warnings into a failed build
    assert config["strict"] is True
    assert config["validation"]["nav"] == {"omitted_files": "warn", "not_found": "warn", "absolute_links": "warn"}
    assert config["validation"]["links"] == {"not_found": "warn", "absolute_links": "warn",
                                             "unrecognized_links": "warn", "anchors": "warn"}


def mkdocs_build(root, site) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the site at ``root`` into ``site``. Never ``--quiet``: it drops the
    warnings before strict mode counts them, and a broken link would pass."""
    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: pip install -e '.[docs]' (the docs extra)")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(root / "mkdocs.yml"), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=300, cwd=root)


def test_mkdocs_build_strict_passes(repo, tmp_path):
    proc = mkdocs_build(repo, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site/troubleshooting/index.html").is_file()
    assert (tmp_path / "site/reference/config/index.html").is_file()


def test_the_strict_build_refuses_an_orphan_page_a_broken_link_and_a_missing_anchor(repo, tmp_path):
    shutil.copytree(repo / "docs", tmp_path / "docs")
    shutil.copy(repo / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "docs/orphan.md").write_text("# Not in the nav\n")
    data = tmp_path / "docs/data.md"
    data.write_text(data.read_text() + "\nSee [gone](gone.md) and [here](#no-such-heading).\n")
    proc = mkdocs_build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0
    assert "orphan.md" in proc.stderr and "gone.md" in proc.stderr and "no-such-heading" in proc.stderr


def test_the_readme_is_short_and_every_link_into_the_docs_resolves(repo):
    readme = (repo / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    assert "make demo" in readme and "make test" in readme
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 14, links
    for link in links:
        assert (repo / link).is_file(), f"README.md links to {link}, which does not exist"
    nav = set(nav_pages(yaml.safe_load((repo / "mkdocs.yml").read_text())["nav"]))
    assert {link.removeprefix("docs/") for link in links} == nav  # every page is reachable from the README
