"""Subcommands of the ``deltasync`` CLI, one module each."""
