"""structlog for everything: JSON lines when not on a terminal, readable console otherwise.

Code in gpu/ and models/ logs through the standard `logging` module (it must
not depend on app/); the ProcessorFormatter renders those records with the
same processors, so the whole log has one format.

Without structlog (a bare GPU machine running `ridgeline bench throughput` or the
offline `LLM`), the standard library's own formatter does: the engine must run
with only torch, triton, transformers and safetensors around it.
"""

from __future__ import annotations

import logging
import sys


class StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever `sys.stderr` is when a line is logged, unless given a
    stream: a process that swaps stderr (pytest's capture, a daemon's redirect) never has
    its lines written to a stream it has closed."""

    def __init__(self):
        self._given = None
        super().__init__()

    @property
    def stream(self):
        return self._given if self._given is not None else sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        self._given = None if value is sys.stderr else value


def configure_logging(json_lines: bool | None = None, level: int = logging.INFO) -> None:
    try:
        import structlog
    except ImportError:
        logging.basicConfig(level=level, stream=sys.stderr, force=True,
                            format="%(asctime)s %(levelname)s %(name)s %(message)s")
        return
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # JSON lines carry a logged exception as its formatted traceback (`exception`), not
    # as the repr of a traceback object; the console renderer prints it itself.
    render = ([structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
              if json_lines else [structlog.dev.ConsoleRenderer(colors=False)])
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
    )
    handler = StderrHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
