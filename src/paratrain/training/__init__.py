"""The training loop and its run files: config, recipes, run directories."""
