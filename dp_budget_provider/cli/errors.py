"""What a command reports besides the ledger's own errors: its exit code says which."""

from __future__ import annotations


class CommandError(Exception):
    """The command cannot do what was asked (exit 1)."""


class UsageError(Exception):
    """The command line is incomplete (exit 2)."""
