"""The one error type raised when input from the wire (or a caller) is malformed."""

from __future__ import annotations


class ValidationError(ValueError):
    """Input rejected at a boundary; `field` names the offending field path (e.g. ``needs[2].priority``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message

    def nested(self, prefix: str) -> ValidationError:
        """The same error with `prefix` prepended to the field path (used when converting nested messages)."""
        if not prefix:
            return self
        if not self.field:
            path = prefix
        elif self.field.startswith("["):
            path = prefix + self.field
        else:
            path = f"{prefix}.{self.field}"
        return ValidationError(path, self.message)
