"""The few errors tpkit raises at its boundaries. Each names what went wrong and the fix.

The CLI prints them in one or two lines and exits non-zero; tracebacks only with --debug.
"""


class TpkitError(Exception):
    """Base class. `fix` is the second line the CLI prints: what the user should do."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"

    def __reduce__(self):
        # Raised in a worker process, it crosses back pickled: keep the fix line (Exception pickles args only).
        return type(self), (self.message, self.fix)


class ConfigError(TpkitError):
    """A bad option, recipe key or value."""


class InputError(TpkitError):
    """A missing, empty, corrupt or inconsistent input file or folder."""


class ModelError(TpkitError):
    """A model (or reward model) that cannot be found or loaded."""


class OutOfMemory(TpkitError):
    """The accelerator ran out of memory: the message names the batch-size options that set the peak."""


class RewardError(TpkitError):
    """A reward that is unknown, fails, or returns unusable values (NaN, wrong length)."""
