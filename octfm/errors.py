"""Errors library code raises; only entry points (octfm/cli.run) turn them into exit codes.

A library module never raises cli.UsageError (an entry-point notion): it raises one of these,
and `cli.run` maps each to its documented exit status (docs/architecture.md, "Exit codes").
"""
from __future__ import annotations


class DataError(Exception):
    """Input data cannot be used as given (a malformed table, a cache without a manifest, too
    few volumes for the batch): the message names the file and the column or key. Exit 2."""


class SetupError(Exception):
    """A tool the command needs is not installed (rclone): the message says how to get it. Exit 2."""
