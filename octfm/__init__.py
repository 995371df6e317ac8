"""Shared plumbing for the octfm stages (typed configs, exit codes, file systems), and
`make report` (report.py), which reads the outputs of every stage."""
import os

# gcsfs probes every bucket over gRPC for hierarchical namespaces unless told not to; on the
# emulator (and behind proxies) each probe waits 60 s. gcsfs reads this at import time.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
