"""What TP ranks tell each other about one update (the vLLM backend's and the SGLang loader's
agreement), with each rank's gather answered from a table instead of a process group."""

from __future__ import annotations

from deltasync.engines.agreement import ASKED_OTHERWISE, failed_ranks


def _gather_with(others: list[tuple]):
    def gather(item):
        return [item, *others]

    return gather


def test_ranks_that_agree_and_succeed_report_no_failure():
    gather = _gather_with([("tp1", None, "version 3")])
    assert failed_ranks("tp0", None, gather, asked="version 3") == []


def test_ranks_asked_for_different_versions_all_fail_naming_what_each_was_asked():
    gather = _gather_with([("tp1", None, "version 4")])
    failed = failed_ranks("tp0", None, gather, asked="version 3")
    assert [s for s, _ in failed] == ["tp0", "tp1"]
    assert all(ASKED_OTHERWISE in err for _, err in failed)
    assert "version 3" in failed[0][1] and "version 4" in failed[1][1]


def test_a_rank_that_failed_keeps_its_own_error_beside_the_disagreement():
    gather = _gather_with([("tp1", "OSError: disk", "version 4")])
    failed = dict(failed_ranks("tp0", None, gather, asked="version 3"))
    assert failed["tp1"].startswith("OSError: disk (") and ASKED_OTHERWISE in failed["tp1"]
