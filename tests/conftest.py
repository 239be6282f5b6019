from __future__ import annotations

import pytest

# Real PostgreSQL / Redis servers for the tests that need them (tests/servers.py).
pytest_plugins = ["servers"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
