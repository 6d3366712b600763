"""Bench, plan, tune, doctor and export: tools around training."""
