"""One process of a run says a thing: the first to get there, not always rank 0.

Under plain torchrun every process meets the same bad input, and one line is enough. Rank 0
alone saying it was not: when another process fails first, the agent stops rank 0 before it
gets there (a busy machine), and the line was said no time. Here each process that wants to
say it claims it in the agent's store (it outlives the processes); the first claim wins.
Where no agent keeps a store, rank 0 says it.
"""

from __future__ import annotations

from datetime import timedelta

from paratrain.utils import environment

#: how long a process waits for the agent's store before it leaves the line to rank 0
_STORE_SECONDS = 10.0


def tell_once(what: str) -> bool:
    """Whether this process is the one to say ``what`` (a short name of the message kind)."""
    env = environment.current()
    if not env.launched:
        return True
    if env.agent_store and env.master_addr and env.master_port:
        try:
            import torch.distributed as dist

            store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                is_master=False,
                timeout=timedelta(seconds=_STORE_SECONDS),
            )
            return int(store.add(f"paratrain/said/attempt-{env.attempt}/{what}", 1)) == 1
        except (RuntimeError, ValueError, OSError):
            pass  # the agent is gone or unreachable: rank 0 says it, as before
    return env.is_rank_zero
