"""structlog JSON logging shared by all services, with a request id that
crosses service boundaries in gRPC metadata."""

import logging
import sys
import uuid

import structlog

LOG_LEVELS = ("debug", "info", "warning", "error")


def check_log_level(level: str) -> None:
    """Config validation shared by the services."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")


def configure_logging(service: str, level: str = "info") -> None:
    """Routes structlog and stdlib logging (grpc, uvicorn) to JSON lines on stderr."""

    def add_service(_, __, event_dict):
        event_dict.setdefault("service", service)
        return event_dict

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_service,
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def new_request_id() -> str:
    return uuid.uuid4().hex


def metadata_value(metadata, key: str) -> str | None:
    """Looks up a key in gRPC invocation metadata (a sequence of (key, value))."""
    for item_key, value in metadata or ():
        if item_key == key:
            return value
    return None


def bind_request_id(request_id: str) -> None:
    """Tags every log line of the current task/thread with the request id."""
    structlog.contextvars.bind_contextvars(request_id=request_id)
