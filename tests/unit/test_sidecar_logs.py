"""The sidecar's log formatter: client text (run ids, alert names, reasons) cannot forge log lines."""

from __future__ import annotations

import logging

from parwatch.cli.sidecar import EscapingFormatter, escape_controls


def test_control_characters_are_escaped_one_record_one_line():
    record = logging.LogRecord(
        "parwatch.sidecar.store",
        logging.WARNING,
        __file__,
        1,
        "run %r replaced by run %s",
        ("a", "b\n2026-01-01 ERROR forged\r\x1b[2K\u2028x"),
        None,
    )
    line = EscapingFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line
    assert line.endswith(r"b\n2026-01-01 ERROR forged\r\x1b[2K\u2028x")


def test_printable_text_is_left_alone():
    assert escape_controls("run 'é' \"7\" 100%") == "run 'é' \"7\" 100%"
