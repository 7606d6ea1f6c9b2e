"""The error of a malformed recipe (imports nothing, so every config module can raise it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A recipe or override is malformed.

    ``ConfigError(key, message)``: ``key`` is the dotted recipe key the error is about.
    A section's ``validate()`` names its own fields (``"top_p"``, ``"sources[1].weight"``;
    ``""``: the section as a whole); the loader puts the section's path in front
    (:meth:`within`), so the error that reaches the user reads
    ``recipe key 'rollout.top_p': must be in (0, 1], got 1.5``.
    ``ConfigError(message)``: about no single key (a recipe file, an override's syntax).
    """

    def __init__(self, key: str | None, message: str | None = None) -> None:
        if message is None:
            key, message = None, key
        self.key = key
        self.message = message or ""
        super().__init__(key, self.message)  # args: what pickling passes back to __init__

    def __str__(self) -> str:
        return f"recipe key '{self.key}': {self.message}" if self.key else self.message

    def within(self, prefix: str) -> ConfigError:
        """This error with its key put under ``prefix`` (the dotted path of the section that
        raised it). Keyless errors are returned unchanged."""
        if self.key is None or not prefix:
            return self
        if not self.key:
            key = prefix
        elif self.key.startswith("["):
            key = f"{prefix}{self.key}"
        else:
            key = f"{prefix}.{self.key}"
        return ConfigError(key, self.message)
