"""The documentation site builds with every warning an error (broken internal links and
anchors included), and the Python examples of its guides run."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Pages whose ```python blocks are complete programs (```py blocks are shown, not run:
# they need a project around them, a server or another process's settings).
GUIDES = sorted([*DOCS.glob("frameworks/*.md"), *DOCS.glob("policies/*.md"), DOCS / "testing.md"])


def test_the_site_builds_strict(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    assert (tmp_path / "reference" / "porch" / "index.html").exists()


@pytest.mark.parametrize("page", GUIDES, ids=[str(p.relative_to(DOCS)) for p in GUIDES])
def test_the_examples_of_a_guide_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        # A module of its own: frameworks resolve annotations through sys.modules.
        module = types.ModuleType("docs_example")
        monkeypatch.setitem(sys.modules, "docs_example", module)
        exec(compile(block, str(page), "exec"), module.__dict__)


def test_the_design_layout_names_every_module() -> None:
    """docs/design.md's Layout describes the tree as it is: every module of src/porch is
    named there, under its folder (a new module is added to it in the same change)."""
    design = (DOCS / "design.md").read_text()
    layout = design[design.index("## Layout") :]
    start = layout.index("```")
    block = layout[start : layout.index("```", start + 3)]
    source = ROOT / "src" / "porch"
    missing = [
        str(path.relative_to(source))
        for path in sorted(source.rglob("*.py"))
        if path.name not in block or (path.parent != source and f"{path.parent.name}/" not in block)
    ]
    assert not missing, f"not in docs/design.md's Layout: {missing}"
