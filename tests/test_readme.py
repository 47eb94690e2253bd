"""The README's Python examples run as pasted, and its module tree names every module.

The trainer example and the receiver example are extracted from the README (the ``python``
block after each ``<!-- example: NAME -->`` marker) and run as fresh interpreters, one after
the other, with ``TMPDIR`` pointing at this test's temp dir: the trainer publishes a run into
a store there, the receiver pulls every shard and checks it bitwise against a dense split of
the trainer's BF16 weights (an ``assert`` in the example itself).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_examples() -> dict[str, str]:
    """``{name: code}`` of every ``<!-- example: name -->`` python block of the README."""
    pattern = re.compile(r"<!-- example: (\w+) -->\s*```python\n(.*?)```", re.S)
    return {m.group(1): m.group(2) for m in pattern.finditer(README.read_text())}


def run_example(code: str, workdir: Path, timeout: float) -> subprocess.CompletedProcess:
    script = workdir / "example.py"
    script.write_text(code)
    env = {**os.environ, "TMPDIR": str(workdir), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_readme_has_a_trainer_and_a_receiver_example() -> None:
    assert set(readme_examples()) == {"trainer", "receiver"}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temp dir in which the README's trainer example has run (store + checkpoint)."""
    workdir = tmp_path_factory.mktemp("readme")
    trainer = run_example(readme_examples()["trainer"], workdir, timeout=180)
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert re.findall(r"^v(\d+): \d+ elements", trainer.stdout, re.M) == ["1", "2", "3"]
    return workdir


@pytest.mark.timeout(400)
def test_the_receiver_example_runs_as_pasted_and_every_shard_is_bit_exact(
    trained_run: Path,
) -> None:
    receiver = run_example(readme_examples()["receiver"], trained_run, timeout=180)
    assert receiver.returncode == 0, receiver.stdout + receiver.stderr
    # every shard reached the trainer's last version, through the anchor and each delta
    shards = re.findall(r"^(tp\d): version 3 via \(0, 1, 2, 3\)", receiver.stdout, re.M)
    assert shards == ["tp0", "tp1"]
    assert "bit-identical" in receiver.stdout


@pytest.mark.timeout(400)
def test_the_receiver_examples_check_fails_for_shards_that_did_not_pull(trained_run: Path) -> None:
    """The example's own bitwise check can fail: without a pull its zero tensors differ."""
    code = readme_examples()["receiver"]
    for old, new in (
        ("report = rx.pull()", "report = None"),
        ('f"rx-{shard}"', 'f"rx-nopull-{shard}"'),
        ("report.version", "None"),
        ("report.chain", "()"),
        ("report.pause_s", "0.0"),
    ):
        assert old in code, old
        code = code.replace(old, new)
    receiver = run_example(code, trained_run, timeout=180)
    assert receiver.returncode != 0
    assert "AssertionError" in receiver.stderr


def modules_in_tree() -> set[str]:
    """Module paths (relative to src/deltasync) in the README's module tree: one entry per
    line, two spaces of indent per folder level, folders ending in ``/``; a folder's own line
    stands for its ``__init__.py``."""
    block = README.read_text().split("## Module tree", 1)[1].split("```", 2)[1]
    found: set[str] = set()
    folders: list[str] = []
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m:
            continue
        depth, entry = len(m.group(1)) // 2, m.group(2)
        if depth == 0:  # the package's own line: src/deltasync/
            folders = []
            found.add("__init__.py")
            continue
        del folders[depth - 1 :]
        if entry.endswith("/"):
            folders.append(entry)
            found.add("".join(folders) + "__init__.py")
        else:
            found.add("".join(folders) + entry)
    return found


def test_the_readme_module_tree_lists_every_module_of_the_package() -> None:
    package = ROOT / "src" / "deltasync"
    actual = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    listed = modules_in_tree()
    assert not actual - listed, f"modules missing from the README tree: {sorted(actual - listed)}"
    assert not listed - actual, (
        f"README tree lists modules that do not exist: {sorted(listed - actual)}"
    )
