"""Machine-readable lines from several processes sharing one stdout pipe stay whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deltasync.commands.apps import emit_json_line

_WRITER = """
import sys
from deltasync.commands.apps import emit_json_line
rank = int(sys.argv[1])
for i in range(300):
    emit_json_line({"rank": rank, "i": i, "pad": "x" * 900})
"""


def test_lines_from_three_unbuffered_processes_on_one_pipe_all_parse() -> None:
    # PYTHONUNBUFFERED makes print() issue the text and its "\n" as two writes, which is how
    # two ranks' lines once fused into "{...}{...}" in CI; emit_json_line must not.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r, w = os.pipe()
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(rank)], stdout=w, env=env)
        for rank in range(3)
    ]
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        out = pipe.read().decode()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    seen = sorted((obj["rank"], obj["i"]) for obj in map(json.loads, out.splitlines()))
    assert seen == sorted((rank, i) for rank in range(3) for i in range(300))


def test_each_line_is_exactly_one_write_call(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    calls: list[bytes] = []
    real_write = os.write

    def spy(fd: int, data) -> int:
        calls.append(bytes(data))
        return real_write(fd, data)

    with open(tmp_path / "out", "w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        monkeypatch.setattr(os, "write", spy)
        emit_json_line({"rank": 3, "pad": "y" * 2000})
        emit_json_line([1, 2])
    assert calls == [json.dumps({"rank": 3, "pad": "y" * 2000}).encode() + b"\n", b"[1, 2]\n"]
    assert (tmp_path / "out").read_bytes() == b"".join(calls)


def test_order_with_print_is_kept_and_capture_works(capsys: pytest.CaptureFixture[str]) -> None:
    print("before")
    emit_json_line({"b": 1, "a": 2}, sort_keys=True)
    print("after")
    assert capsys.readouterr().out == 'before\n{"a": 2, "b": 1}\nafter\n'
