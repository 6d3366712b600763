"""Errors that mean "the user asked for something we cannot do".

The CLI turns a :class:`UserError` into one line on stderr and exit code 2, never a
traceback. Library users can catch it like any ``ValueError``.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: the message says what was wrong and what to do instead."""


class PlacementError(UserError):
    """A batch or tensor that the runtime cannot put on the strategy's device."""


class LaunchError(RuntimeError):
    """A process of a multi-process run failed, was killed, or never joined the group.

    The message names the rank and the cause (its traceback or the signal). The CLI prints
    it as one error and exits with code 1: the input was fine, the run was not.
    """


class NonFiniteLossError(LaunchError):
    """A loss was NaN or infinite: every process stops at the same step with this message,
    which names the rank(s) and the step."""
