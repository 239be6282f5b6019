"""The docs name the tests that show what they claim: every named test exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["docs/ietf-idempotency-key.md", "docs/idempotency.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_a_doc_names_exists(doc: str) -> None:
    text = (ROOT / doc).read_text()
    named = re.findall(r"`(?:[\w/]*/)?(\w+\.py)::(\w+)`|`::(\w+)`", text)
    assert named, f"{doc} names no test"
    current = ""
    for file, name, same_file in named:
        current = file or current
        test = name or same_file
        found = [
            path
            for path in (ROOT / "tests").rglob(current)
            if re.search(rf"^(async )?def {test}\(", path.read_text(), flags=re.M)
        ]
        assert found, f"{doc}: {current}::{test} does not exist"
