"""Errors raised while resolving `tokenspeed serve` arguments."""

from __future__ import annotations


class ConfigError(Exception):
    """A bad value, an unknown flag or config key, or conflicting flags. Exit status 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotSupportedError(ConfigError):
    """A valid flag whose feature (or value) is not built yet. Each line of the message reads
    `not supported yet: --flag (what it does)`. Exit status 2, like other usage errors."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines
