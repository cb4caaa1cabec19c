"""How ``kvmem`` writes its log: ``--log-format text`` (the default, one line a record,
``2026-01-01 12:00:00,000 INFO kvmem.server serving ...``, UTC) or ``json`` (one JSON
object a line, for log collectors: ``ts``, ``level``, ``logger``, ``message``, and
``exception`` / ``stack`` when the record carries them).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in the message or a traceback
    are escaped by JSON, so a record never spans lines). ``ts`` is ISO 8601 in UTC with
    milliseconds; ``message`` has its %-arguments applied."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, str] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str = "info", log_format: str = "text") -> None:
    """The root logger: ``level`` (debug, info, warning, error) and ``log_format`` (one of
    :data:`LOG_FORMATS`), on stderr."""
    if log_format == "json":
        formatter: logging.Formatter = JsonFormatter()
    else:
        formatter = logging.Formatter(TEXT_FORMAT)
        formatter.converter = time.gmtime
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
