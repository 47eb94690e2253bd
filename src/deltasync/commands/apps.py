"""Lazy imports of the applications behind ``demo``, ``rl-demo``, ``bench`` and ``cluster-worker``.

The library does not depend on its applications: they live outside the package (the
repository's ``examples/`` and ``bench/``, installed beside it as ``deltasync_examples`` and
``deltasync_bench``) and a command imports its application only when it runs. When one is
missing (a wheel built without them, a checkout on ``PYTHONPATH=src``), the command fails with
a typed error that says how to get it, instead of an ImportError traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from deltasync.errors import ApplicationMissingError

_FOLDERS = {"deltasync_examples": "examples/", "deltasync_bench": "bench/"}


def import_app(module: str, command: str) -> ModuleType:
    """Import ``module`` (e.g. ``deltasync_examples.demo.run``) for ``deltasync COMMAND``.

    Args:
        module: the application module's dotted name.
        command: the CLI command that needs it (named in the error).

    Returns:
        The imported module.

    Raises:
        ApplicationMissingError: its top-level package is not installed.
    """
    package = module.split(".", 1)[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".", 1)[0] != package:
            raise  # the application is there; something it imports is not
        raise ApplicationMissingError(
            f"`deltasync {command}` needs the {package} package ({_FOLDERS.get(package, '')} in "
            f"the deltasync repository), which is not installed; from a clone run "
            f"`pip install -e .` (or `make setup`) there"
        ) from exc
