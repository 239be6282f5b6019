"""The operator CLI's text output in process (the commands against running servers are in
tests/e2e/test_operator.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from porch.ops.cli import main
from porch.store.base import Hit, Save, StoredResponse
from porch.store.sqlite import SQLiteStore

EVIL = "\x1b[2J\x1b]0;owned\x07\u202e"


def test_control_characters_are_escaped_in_the_text_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Catches: client keys and scopes printed raw, so a custom key returning header text
    # put terminal escapes on the operator's screen (issue 26, finding 9).
    async def fill() -> None:
        store = SQLiteStore(tmp_path)
        await store.open()
        try:
            await store.apply([Hit([f"rl\x1fr{EVIL}\x1fl\x1fc{EVIL}"], [5], [600.0])])
            response = StoredResponse(b"d" * 32, 201, (), b"{}")
            await store.apply([Save(f"s{EVIL}\x1fk{EVIL}", response, 600.0, scope=f"s{EVIL}")])
        finally:
            await store.close()

    asyncio.run(fill())
    assert main(["inspect", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\u202e"), out
    assert r"c\x1b[2J\x1b]0;owned\x07\u202e" in out
    assert r"rule=r\x1b[2J" in out
    assert r"s\x1b[2J" in out


@pytest.mark.parametrize(
    ("text", "escaped"),
    [("10.0.0.1", "10.0.0.1"), ("caf\xe9 user", "caf\xe9 user"), ("a\\x1b", "a\\\\x1b")],
)
def test_printable_text_is_shown_as_is_and_backslashes_escaped(text: str, escaped: str) -> None:
    from porch.ops._operator import shown

    assert shown(text) == escaped
