"""Errors a user can act on. Each names what was wrong (file, tensor, argument) in one line."""


class DeltaserveError(Exception):
    """Base class of every error deltaserve raises on purpose."""


class ModelLoadError(DeltaserveError, ValueError):
    """A checkpoint could not be read: corrupt or truncated file, unknown architecture,
    missing or mis-shaped tensor, unsupported tensor type."""

    def __init__(self, path, problem: str, tensor: str | None = None):
        self.path, self.problem, self.tensor = str(path), problem, tensor
        where = f"{self.path}: tensor '{tensor}'" if tensor else self.path
        super().__init__(f"{where}: {problem}")


class ChatTemplateError(DeltaserveError):
    """A chat template (code that ships inside a checkpoint) failed or went past its budget of time, loop
    iterations or text while rendering a request: the request is refused (HTTP 400), the process goes on."""


class SlotBusyError(DeltaserveError):
    """A slot operation (save, restore, erase) named a slot that is serving a request (HTTP 409)."""
