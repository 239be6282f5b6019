"""Every optional dependency that is missing is a message naming the extra, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Run in a fresh interpreter where the module cannot be imported (sys.modules[name] = None).
HIDE = "import sys; sys.modules[{name!r}] = None; sys.argv = {argv!r}; "


def run_without(name: str, argv: list[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HIDE.format(name=name, argv=argv) + code],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("missing", ["starlette", "uvicorn", "prometheus_client"])
def test_porch_demo_names_the_extra(missing: str) -> None:
    done = run_without(
        missing,
        ["porch", "demo", "--port", "1"],
        "from porch.ops.cli import main; sys.exit(main())",
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"porch demo needs {missing}: pip install 'porch[demo]'" in done.stderr


@pytest.mark.parametrize(
    ("missing", "code", "extra"),
    [
        ("prometheus_client", "from porch import PorchMetrics; PorchMetrics()", "metrics"),
        ("asyncpg", "from porch import open_store; open_store('postgresql://h/db')", "postgres"),
        ("redis", "from porch import open_store; open_store('redis://h:6379/0')", "redis"),
    ],
)
def test_library_extras_raise_configuration_errors(missing: str, code: str, extra: str) -> None:
    done = run_without(
        missing,
        ["x"],
        "from porch import ConfigurationError\n"
        f"try:\n    {code}\nexcept ConfigurationError as exc:\n    print(exc)\n",
    )
    assert done.returncode == 0, done.stderr
    assert f"pip install 'porch[{extra}]'" in done.stdout


def test_wsgi_needs_no_framework() -> None:
    done = run_without("starlette", ["x"], "import porch.integrations.wsgi; print('ok')")
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize(
    ("missing", "module", "extra"),
    [
        ("fastapi", "fastapi", "fastapi"),
        ("starlette", "fastapi", "fastapi"),  # FastAPI needs Starlette: its extra brings both
        ("starlette", "starlette", "starlette"),
        ("litestar", "litestar", "litestar"),
        ("quart", "quart", "quart"),
        ("flask", "flask", "flask"),
    ],
)
def test_each_integration_names_its_extra(missing: str, module: str, extra: str) -> None:
    done = run_without(missing, ["x"], f"import porch.integrations.{module}")
    assert done.returncode == 1
    assert f"porch.integrations.{module} needs" in done.stderr
    assert f"pip install 'porch[{extra}]'" in done.stderr
