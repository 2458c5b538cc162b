"""How a worker logs a failure it survives: the frames and the type, never the message, which
may quote request text (request text never reaches the logs)."""

from __future__ import annotations

import logging
import traceback

log = logging.getLogger(__name__)


def log_failure(what: str, err: BaseException) -> None:
    """An unexpected failure's frames and type, not its message, which may quote request text."""
    log.error("%s failed unexpectedly (%s):\n%s", what, type(err).__name__,
              "".join(traceback.format_tb(err.__traceback__)))
