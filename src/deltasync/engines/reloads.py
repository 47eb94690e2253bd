"""An engine's own weight loads, seen by the hook that holds a version over its weights.

vLLM's ``reload_weights`` and SGLang's ``update_weights_from_disk`` write the live weights
through the model's ``load_weights``; deltasync never calls it. :func:`watch_loads` wraps
that method once per model: it counts the calls (on entry and on return, so a load under way
when a stamp is taken moves the count either way: :func:`loads_of`) and, as each returns or
raises, calls back the hook that registered last (a re-init's or a new shard's, never one
that is gone), so that the hook stops holding its version at once. What the callback raises
is logged, never the reload's failure.

This module knows a model's ``load_weights`` and nothing of receivers or engines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_LOADS = "_deltasync_loads"  # the model attribute counting its load_weights calls
_AFTER_LOAD = "_deltasync_after_load"  # the model attribute: the callback after each load


def watch_loads(model: torch.nn.Module, after: Callable[[], None]) -> None:
    """Count ``model.load_weights`` calls from now on (the count is kept across calls) and
    call ``after``, in place of any callback registered before, once each has ended. A model
    without a callable ``load_weights`` is left as it is."""
    if getattr(model, _LOADS, None) is None:
        load = getattr(model, "load_weights", None)
        if not callable(load):
            return
        count = [0]

        def load_weights(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            try:
                return load(*args, **kwargs)
            finally:
                count[0] += 1
                try:
                    getattr(model, _AFTER_LOAD)()
                except Exception:  # never the reload's failure
                    log.exception("deltasync: the check after load_weights failed")

        model.load_weights = load_weights
        setattr(model, _LOADS, count)
    setattr(model, _AFTER_LOAD, after)


def loads_of(model: torch.nn.Module) -> int:
    """How many times :func:`watch_loads`' count moved (entries and returns); 0 unwatched."""
    count = getattr(model, _LOADS, None)
    return count[0] if count is not None else 0
