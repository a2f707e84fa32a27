"""The exception types the CLI turns into one line (no traceback) or none."""


class DFlowError(Exception):
    """A user-facing error: bad input, a missing file, a mismatched checkpoint."""


class QuietInterrupt(KeyboardInterrupt):
    """A stop the CLI reports with no line of its own: a DDP process other than the main one, stopped by
    the same signal as the main one, which says why (one line, not one per process)."""
