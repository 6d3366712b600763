"""Starting processes: torchrun's agent, watchdogs, signals, threads."""
