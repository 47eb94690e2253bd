"""Subcommands of the ``deltasync`` CLI: the application commands (``apps``), ``layout``,
``inspect`` (``inspect_store``) and ``pull``."""
