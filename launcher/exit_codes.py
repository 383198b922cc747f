"""Exit codes a scheduler can act on (documented in the README)."""

OK = 0
"""Every rank finished successfully."""

JOB_FAILED = 1
"""The job failed and the restart budget is spent; requeueing may help."""

USAGE = 2
"""Bad flags, config file or script: fix the command line; requeueing will not help."""

DO_NOT_REQUEUE = 3
"""Unhealthy hardware or no progress across recoveries: a human must look first."""

SIGNAL_BASE = 128
"""Stopped by signal N (forwarded to ranks first): exit 128 + N, as a shell reports it."""
