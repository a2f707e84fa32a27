"""The one exception type the CLI turns into a one-line error (no traceback)."""


class DFlowError(Exception):
    """A user-facing error: bad input, a missing file, a mismatched checkpoint."""
