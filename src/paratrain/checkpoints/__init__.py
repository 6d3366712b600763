"""Checkpoint files of any layout, the training state, full weights."""
