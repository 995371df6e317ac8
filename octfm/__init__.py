"""Shared plumbing for the octfm stages: typed configs, exit codes, file systems."""
