from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from porch import ConfigurationError, SQLiteStore, open_store


def test_sqlite_urls_name_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absolute = open_store(f"sqlite:///{tmp_path}/data/counts.sqlite3", durability="power")
    assert isinstance(absolute, SQLiteStore)
    assert absolute.path == tmp_path / "data" / "counts.sqlite3"
    assert absolute.durability == "power"
    monkeypatch.chdir(tmp_path)
    relative = open_store("sqlite:state/porch.sqlite3")
    assert isinstance(relative, SQLiteStore)
    assert relative.path == Path("state") / "porch.sqlite3"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://db/x", "unknown store URL scheme 'mysql'.*known: sqlite, postgresql, postgres"),
        ("porch.sqlite3", "a store URL needs a scheme"),
        ("sqlite://host/x.sqlite3", "no host, query or fragment"),
        ("sqlite:///tmp/dir/", "must name a file"),
    ],
)
def test_bad_urls_are_configuration_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        open_store(url)


def test_bad_options_are_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="busy_timeout must be >= 0"):
        open_store(f"sqlite:///{tmp_path}/x.sqlite3", busy_timeout=-1)


@pytest.mark.parametrize(
    ("url", "module", "extra"),
    [
        ("postgresql://porch@127.0.0.1:5432/porch", "porch.store.postgres", "porch[postgres]"),
        ("postgres://porch@127.0.0.1/porch", "porch.store.postgres", "porch[postgres]"),
        ("redis://127.0.0.1:6379/0", "porch.store.redis", "porch[redis]"),
        ("rediss://127.0.0.1:6379/0", "porch.store.redis", "porch[redis]"),
        ("unix:///run/redis.sock", "porch.store.redis", "porch[redis]"),
    ],
)
def test_a_missing_driver_names_the_extra(
    url: str, module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes the import fail as a missing driver does.
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigurationError, match=re.escape(f"pip install '{extra}'")):
        open_store(url)
