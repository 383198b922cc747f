"""ftlaunch: a fault-tolerant launcher for distributed PyTorch training."""

__version__ = "0.1.0"


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2, nothing started."""
