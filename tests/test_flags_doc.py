"""docs/flags.md is generated from the flag table and cannot go stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenspeed.config import FLAGS
from tokenspeed.config.__main__ import flags_markdown, main

DOC = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def test_flags_doc_is_the_generators_output() -> None:
    assert DOC.read_text() == flags_markdown(), (
        "docs/flags.md differs from the flag table: "
        "run `python -m tokenspeed.config --markdown > docs/flags.md`"
    )


def test_flags_doc_details_every_implemented_flag_and_lists_every_refused_one() -> None:
    doc = flags_markdown()
    for flag in FLAGS:
        heading = f"### `{flag.name}`\n"
        assert (heading in doc) == flag.implemented, flag.name
        assert f"`{flag.name}`" in doc
        for spelling in (*flag.aliases, *flag.negated):
            assert f"`{spelling}`" in doc, spelling


def test_markdown_mode_prints_the_doc(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out == flags_markdown()
