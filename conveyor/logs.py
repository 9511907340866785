"""How Conveyor says what it is doing: one format, at INFO, on stderr. The server, its replicas
and ranks configure it for the process; ``LLM`` only where the application has not."""

from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONFIGURE_LOGGING = "CONVEYOR_CONFIGURE_LOGGING"


def configure_logging() -> None:
    """The process's logging, for Conveyor's own commands (a no-op where it is set up)."""
    logging.basicConfig(level=logging.INFO, format=FORMAT)


def show_progress() -> None:
    """As vLLM's ``LLM`` does, say at INFO on stderr what the start-up is doing (a first start
    compiles the kernels for a while, then the model loads), unless the application has set up
    logging itself or ``CONVEYOR_CONFIGURE_LOGGING=0``."""
    logger = logging.getLogger("conveyor")
    if (os.environ.get(CONFIGURE_LOGGING, "1") == "0" or logger.handlers
            or logging.getLogger().handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
