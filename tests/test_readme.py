from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        namespace: dict[str, object] = {"__name__": "readme_example"}  # Flask(__name__)
        # The example leaves the routes to the reader.
        exec(compile(block.replace("routes=[...]", "routes=[]"), "README.md", "exec"), namespace)
        app = namespace.get("app")
        if app is not None:
            # Starlette builds its middleware (and so validates it) on first use.
            app.build_middleware_stack()  # type: ignore[attr-defined]
