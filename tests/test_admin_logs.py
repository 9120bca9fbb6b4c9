"""Structured logs: JSON lines with coordinates, and never a payload."""

from __future__ import annotations

import io
import json
import logging

from nemesis.logs import bind, configure_logging, say


def fail() -> None:
    raise ValueError("boom")


def test_json_lines_carry_coordinates_and_nothing_else() -> None:
    stream = io.StringIO()
    configure_logging("debug", "json", stream)
    try:
        log = bind(logging.getLogger("nemesis.test"), integration="orders", flow="main")
        log.warning(
            "commit of %s/%s failed",
            "orders",
            3,
            extra={"topic": "orders", "partition": 3, "offset": 41, "payload": b"secret"},
        )
        try:
            fail()
        except ValueError:
            logging.getLogger("nemesis.test").exception("with a traceback")
    finally:
        configure_logging("info", "text")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "commit of orders/3 failed"
    assert first["level"] == "warning"
    assert first["logger"] == "nemesis.test"
    assert (first["integration"], first["flow"], first["partition"], first["offset"]) == (
        "orders",
        "main",
        3,
        41,
    )
    assert "payload" not in first
    assert "secret" not in stream.getvalue()
    assert first["ts"].endswith("Z")
    assert "ValueError: boom" in second["exc"]


def test_configuring_again_replaces_the_handler() -> None:
    stream = io.StringIO()
    configure_logging("info", "text", stream)
    configure_logging("info", "text", stream)
    try:
        logging.getLogger("nemesis.test").info("once")
    finally:
        configure_logging("info", "text")
    assert stream.getvalue().count("once") == 1


def test_libraries_log_at_warning_and_above_unless_told_otherwise() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    try:
        logging.getLogger("aiokafka.consumer").info("joined group")
        logging.getLogger("aiokafka.consumer").warning("heartbeat failed")
        logging.getLogger("nemesis.test").info("ours")
        configure_logging("info", "json", stream, library_level="info")
        logging.getLogger("aiokafka.consumer").info("joined again")
    finally:
        configure_logging("info", "text")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(r["logger"], r["msg"]) for r in lines] == [
        ("aiokafka.consumer", "heartbeat failed"),
        ("nemesis.test", "ours"),
        ("aiokafka.consumer", "joined again"),
    ]


def test_a_commands_words_are_a_json_record_when_the_log_is_json() -> None:
    stream = io.StringIO()
    configure_logging("warning", "json", stream)
    try:
        say("3 of 3 shown")
    finally:
        configure_logging("info", "text")
    [record] = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert (record["logger"], record["level"], record["msg"]) == (
        "nemesis.cli",
        "info",
        "3 of 3 shown",
    )
