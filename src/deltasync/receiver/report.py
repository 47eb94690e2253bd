"""PullReport: what one ``Receiver.pull`` (or start-up repair) did, with its timings. Data only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PullReport:
    version: int | None  # the verified version the tensors hold now
    previous_version: int | None  # what they held before (None: nothing verified)
    chain: tuple[int, ...] = ()  # versions applied, in order (first may be an anchor)
    from_anchor: bool = False
    repaired: bool = False  # this finished an apply a crash interrupted
    bytes_fetched: int = 0
    elements_written: int = 0
    stage_s: float = 0.0  # fetch, verify, decode, fold: the engine keeps serving
    pause_s: float = 0.0  # scatter into the live tensors: the engine must not read them
    verify_s: float = 0.0  # digest of the resulting state (after the pause)
    total_s: float = 0.0

    @property
    def changed(self) -> bool:
        return bool(self.chain)
