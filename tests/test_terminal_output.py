"""Hostile payloads and errors reach a terminal inert: ``nemesis dlq list/show``, the helpers."""

from __future__ import annotations

import json

import pytest

from nemesis.dlq import DeadLetter, Reason
from nemesis.dlq.sqlite import open_sqlite_dlq
from nemesis.terminal import inert, inert_json
from tests.conftest import Workspace

# What a terminal acts on instead of showing: a title change, a screen clear,
# a bidi override that reverses what follows, a zero-width joiner, a line separator.
HOSTILE_ERROR = "422 bad \x1b]0;owned\x07 field \u202eexe.txt\u200d\u2028end\x9b2J"
HOSTILE_PAYLOAD = b'{"name": "\\u001b[2J\\u202eevil", "note": "\xe2\x80\xae raw bidi"}'  # JSON
HOSTILE_TEXT = "line one\n\x1b[31mred\x1b[0m\r\u202eover".encode()  # not JSON
HIDDEN = ("\x1b", "\x07", "\u202e", "\u200d", "\u2028", "\x9b", "\r")


def assert_inert(text: str) -> None:
    for char in HIDDEN:
        assert char not in text, (repr(char), text)


async def dead_letters(workspace: Workspace) -> list[str]:
    store = await open_sqlite_dlq(workspace.root / "dlq.db")
    letters = [
        DeadLetter(
            integration="loyalty",
            event_id=f"orders:0:{offset}",
            payload=payload,
            reason=Reason.HTTP_4XX,
            error=HOSTILE_ERROR,
            source_topic="orders",
            source_partition=0,
            source_offset=offset,
            http_status=422,
            key="k\x1b[1m",
            metadata={"type": "order\u202ecreated", "x-note": "\x1b[2J"},
        )
        for offset, payload in enumerate((HOSTILE_PAYLOAD, HOSTILE_TEXT))
    ]
    try:
        await store.put(letters)
    finally:
        await store.close()
    return [letter.id for letter in letters]


async def test_dlq_list_and_show_print_hostile_text_inert(workspace: Workspace) -> None:
    ids = await dead_letters(workspace)

    listed = workspace.cli("dlq", "list")
    assert listed.returncode == 0, listed.stderr
    assert_inert(listed.stdout)
    # One line per row: the line separator became a space, the rest is escaped.
    assert "\\x1b]0;owned\\x07 field \\u202eexe.txt\\u200d end\\x9b2J" in listed.stdout

    for row_id in ids:
        shown = workspace.cli("dlq", "show", row_id)
        assert shown.returncode == 0, shown.stderr
        assert_inert(shown.stdout)
        assert "\\u202eexe.txt" in shown.stdout
        assert "k\\x1b[1m" in shown.stdout
    # A text payload keeps its lines; the controls inside them are escaped.
    assert "line one\n\\x1b[31mred\\x1b[0m\\x0d\\u202eover" in shown.stdout


async def test_dlq_json_output_is_inert_and_parses_to_the_same_values(
    workspace: Workspace,
) -> None:
    ids = await dead_letters(workspace)
    listed = workspace.cli("dlq", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert_inert(listed.stdout)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert {row["error"] for row in rows} == {HOSTILE_ERROR}
    shown = workspace.cli("dlq", "show", ids[0], "--json")
    assert shown.returncode == 0, shown.stderr
    assert_inert(shown.stdout)
    row = json.loads(shown.stdout)
    assert row["metadata"]["type"] == "order\u202ecreated"
    assert json.loads(row["payload"])["name"] == "\x1b[2J\u202eevil"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain ascii, nothing to do", "plain ascii, nothing to do"),
        ("кириллица и emoji 🚀 stay", "кириллица и emoji 🚀 stay"),
        ("a\tb\nc", "a\\x09b\\x0ac"),
        ("\x1b[2J", "\\x1b[2J"),
        ("\u202e\u2066\u200b", "\\u202e\\u2066\\u200b"),
        ("tag \U000e0041", "tag \\U000e0041"),
        ("del \x7f c1 \x85", "del \\x7f c1 \\x85"),
    ],
)
def test_inert_escapes_what_a_terminal_acts_on(text: str, shown: str) -> None:
    assert inert(text) == shown


def test_inert_multiline_keeps_newlines_and_tabs_only() -> None:
    assert inert("a\n\tb\r\n\x1b", multiline=True) == "a\n\tb\\x0d\n\\x1b"


@pytest.mark.parametrize(
    "value",
    ["\u202e", "\x7f\x85", "\U000e0041 tag", "\u2028\u2029", "plain", {"k\u202e": ["\u200d"]}],
)
def test_inert_json_parses_to_the_same_value(value: object) -> None:
    import orjson

    text = inert_json(orjson.dumps(value).decode())
    assert_inert(text)
    assert json.loads(text) == value
