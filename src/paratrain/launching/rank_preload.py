"""Imported once by the fork server that starts ``rt.launch``'s processes
(:mod:`paratrain.launching.rank_start`), never by anything else: what every process that
trains imports anyway, so that the processes forked from the server start with it."""

from __future__ import annotations

import signal

import torch
import torch._dynamo  # a torch optimizer imports it: seconds of CPU
import torch.distributed
import torch.nn.parallel

import paratrain.launching.launch  # noqa: F401  (the processes' entry point)

# A SIGTERM to the launcher's process group (a scheduler's stop) must reach the processes,
# which save and stop, not end the server (and with it, every process it started).
signal.signal(signal.SIGTERM, signal.SIG_IGN)
del torch
