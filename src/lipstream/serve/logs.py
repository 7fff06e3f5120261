"""The server's logs as JSON lines on stderr, for a plain server and a fleet's processes alike. Light on
purpose: a fleet's driver sets them up without importing torch, which only its replicas need."""

from __future__ import annotations

import json
import logging
import re
import sys

# a path's query: "/v1/sessions/x/speech?token=KEY" -> "/v1/sessions/x/speech". uvicorn's own lines
# ("WebSocket /path?query [accepted]", "403") carry the query, and a browser's key rides in it
_QUERY = re.compile(r"(/[^\s?\"']*)\?[^\s\"']*")


def without_queries(text: str) -> str:
    """`text` with the query string of every path in it left out: no ?token= ever reaches a log."""
    return _QUERY.sub(r"\1", text) if "?" in text else text


class JsonLines(logging.Formatter):
    """One JSON object a line: what log collectors parse."""

    def format(self, record: logging.LogRecord) -> str:
        message = without_queries(record.getMessage())
        try:
            fields = json.loads(message) if message.startswith("{") else {"message": message}
        except json.JSONDecodeError:
            fields = {"message": message}
        out = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name, **fields}
        if record.exc_info:
            out["error"] = without_queries(self.formatException(record.exc_info).splitlines()[-1])
        return json.dumps(out)


def json_logs(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = name != "uvicorn.access"  # requests are logged by the app
    for name in ("aioice", "aiortc"):  # a line per ICE candidate pair and state at INFO
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
