"""How every rmsft process picks its log level: an explicit flag, else `RMSFT_LOG_LEVEL` (what the
operator renders from `spec.monitoring.logLevel` into every pod), else the process's own default.

One helper so `rmsft serve`, `rmsft train`, `rmsft local` and `rmsft operator` cannot disagree on
the names or on what a bad value does.
"""

from __future__ import annotations

import logging
import os

ENV = "RMSFT_LOG_LEVEL"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
DEFAULT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class LogLevelError(ValueError):
    """A log level that is not one of `LEVELS`; the message names where it came from."""


def parse_level(value: str, source: str = ENV) -> int:
    """`debug|info|warning|error` (any case) -> the logging level; LogLevelError otherwise."""
    key = value.strip().lower()
    if key not in LEVELS:
        raise LogLevelError(f"{source} must be one of {', '.join(LEVELS)} (spec.monitoring.logLevel), got {value!r}")
    return LEVELS[key]


def resolve_level(default: str, override: str | None = None) -> int:
    """The level a process should log at: `override` (an explicit flag), else RMSFT_LOG_LEVEL when
    set and not empty, else `default`."""
    if override:
        return parse_level(override, "log level")
    env = os.environ.get(ENV, "")
    if env.strip():
        return parse_level(env, ENV)
    return parse_level(default, "default log level")


def configure_logging(default: str, *, override: str | None = None, fmt: str = DEFAULT_FORMAT) -> int:
    """Set the root logger's level (see `resolve_level`) and give it a stderr handler when it has
    none. Returns the level. Raises LogLevelError for a bad value before touching logging."""
    level = resolve_level(default, override)
    logging.basicConfig(level=level, format=fmt)
    # basicConfig does nothing when the root logger already has a handler (an embedding program,
    # pytest); the level must apply anyway.
    logging.getLogger().setLevel(level)
    return level
