"""The command line: the parser, one module per subcommand, each process's entry."""
