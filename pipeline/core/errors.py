"""One exception family. Library code raises these; only the CLI turns them into exit codes."""
from __future__ import annotations


class PipelineError(Exception):
    """Base class: a user-facing problem with a one-line message and an optional hint."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message

    def __str__(self) -> str:
        return self.one_line()


class ConfigError(PipelineError):
    exit_code = 2


class DataError(PipelineError):
    exit_code = 2


class MissingArtifact(PipelineError):
    exit_code = 3


class GateFailed(PipelineError):
    exit_code = 4


class NonFiniteError(GateFailed):
    """NaN/Inf seen where finite numbers were required (loss, outputs)."""


class EngineCrash(PipelineError):
    """A child process (Paddle Lite opt / predictor) died: signal or non-zero exit."""
    exit_code = 5


class IntegrityError(PipelineError):
    """A file's hash does not match its manifest, or an archive member is unsafe."""
    exit_code = 6


class RegressionFound(PipelineError):
    exit_code = 7


class StorageError(PipelineError):
    """A file system refused a write or read: read-only, full, no permission (one line naming stage and path)."""
    exit_code = 8


class RunLocked(PipelineError):
    """Another process is writing the same run folder."""
    exit_code = 9
