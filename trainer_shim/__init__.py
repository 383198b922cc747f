"""trainer_shim: what a training script imports to unlock ftlaunch's fast recovery paths.

Every call is a cheap no-op when the script runs without an ftlaunch agent (plain python,
or under torchrun), so one script runs everywhere. The API grows with issue #4.
"""

import os


def is_managed() -> bool:
    """True when this process is a rank started by an ftlaunch agent."""
    return "FTLAUNCH_RUN_ID" in os.environ
