"""The exception that makes a rank leave its training function to re-enter it in place."""


class RestartRequested(BaseException):  # noqa: N818 - reads as what happened
    """Raised in the training thread when the agent recovers the job: leave, then re-enter.

    A BaseException, so a script's ``except Exception`` does not swallow it. Never raised
    without an agent."""
