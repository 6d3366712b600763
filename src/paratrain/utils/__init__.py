"""Small shared utilities: atomic writes, errors, FLOPs, peak memory, fault injection points."""
