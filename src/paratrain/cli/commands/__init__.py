"""One module per `paratrain` subcommand. Each has ``register(subparsers)``, which adds its
parser and sets ``handler`` to a function ``(args) -> exit code``."""

#: the subcommands, in the order `paratrain --help` lists them
COMMAND_MODULES = (
    "train",
    "run",
    "slurm",
    "info",
    "recipes",
    "ckpt",
    "bench",
    "plan",
    "doctor",
    "export",
    "tune",
    "data",
)
