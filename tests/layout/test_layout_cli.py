"""``deltasync layout split``: the exact command-line interface outside checks depend on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from deltasync.cli import main
from deltasync.layout import ModelSpec, ReceiverLayout

from layout_cases import CONFIGS, bitwise_equal, random_state

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.run(
        [sys.executable, "-m", "deltasync", "layout", "split", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


def run_in_process(capsys, *args: str) -> tuple[int, str]:
    """The same entry point without a new interpreter (torch import costs seconds here)."""
    rc = main(["layout", "split", *args])
    return rc, capsys.readouterr().err


def write_checkpoint(tmp_path: Path, config_name: str, **overrides):
    cfg = dict(CONFIGS[config_name], **overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = ModelSpec.from_hf_config(cfg)
    full = random_state(spec, seed=31)
    save_file(full, str(tmp_path / "full.safetensors"))
    return spec, full


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("config_name", "engine", "tp", "ep", "subprocess_"),
    [
        ("moe_untied", "vllm", 2, 4, True),
        ("dense_tied", "vllm", 4, 1, False),
        ("moe_tied", "hf", 1, 1, False),
    ],
)
def test_split_writes_one_file_per_shard_and_shards_json_that_merge_back_bitwise(
    tmp_path, capsys, config_name, engine, tp, ep, subprocess_
):
    spec, full = write_checkpoint(tmp_path, config_name)
    args = [
        "--config",
        str(tmp_path / "config.json"),
        "--checkpoint",
        str(tmp_path / "full.safetensors"),
        "--engine",
        engine,
        "--tp",
        str(tp),
        "--out",
        str(tmp_path / "out"),
    ]
    if ep != 1:
        args += ["--ep", str(ep)]
    if subprocess_:
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
    else:
        rc, err = run_in_process(capsys, *args)
        assert rc == 0, err
    layout = ReceiverLayout.build(spec, engine, tp, ep)
    listing = json.loads((tmp_path / "out" / "shards.json").read_text())
    assert listing == [
        {"id": s.id, "tp_rank": s.tp_rank, "ep_rank": s.ep_rank} for s in layout.shards()
    ]
    assert all(set(entry) == {"id", "tp_rank", "ep_rank"} for entry in listing)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == sorted([f"{e['id']}.safetensors" for e in listing] + ["shards.json"])
    shards = {e["id"]: load_file(str(tmp_path / "out" / f"{e['id']}.safetensors")) for e in listing}
    for e in listing:
        specs = layout.local_specs(e["id"])
        assert {n: tuple(t.shape) for n, t in shards[e["id"]].items()} == {
            n: s.shape for n, s in specs.items()
        }
    merged = layout.merge(shards)
    assert merged.keys() == full.keys() and all(bitwise_equal(merged[n], full[n]) for n in full)


@pytest.mark.timeout(120)
def test_split_names_vllm_shards_by_tp_rank_alone_when_expert_parallelism_is_off(tmp_path):
    write_checkpoint(tmp_path, "moe_tied")
    proc = run_cli(
        "--config",
        str(tmp_path / "config.json"),
        "--checkpoint",
        str(tmp_path / "full.safetensors"),
        "--engine",
        "vllm",
        "--tp",
        "2",
        "--out",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 0, proc.stderr
    listing = json.loads((tmp_path / "out" / "shards.json").read_text())
    assert listing == [
        {"id": "tp0", "tp_rank": 0, "ep_rank": 0},
        {"id": "tp1", "tp_rank": 1, "ep_rank": 0},
    ]
    tp1 = load_file(str(tmp_path / "out" / "tp1.safetensors"))
    assert "model.layers.0.mlp.experts.w13_weight" in tp1 and "lm_head.weight" not in tp1


@pytest.mark.timeout(120)
def test_split_of_a_checkpoint_that_does_not_fit_its_config_fails_with_a_named_tensor(
    tmp_path, capsys
):
    write_checkpoint(tmp_path, "dense_untied")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 32  # the checkpoint was written with 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, err = run_in_process(
        capsys,
        "--config",
        str(tmp_path / "config.json"),
        "--checkpoint",
        str(tmp_path / "full.safetensors"),
        "--engine",
        "vllm",
        "--tp",
        "2",
        "--out",
        str(tmp_path / "out"),
    )
    assert rc == 2
    assert "LayoutError" in err and "mlp.gate_proj.weight" in err
    assert not (tmp_path / "out" / "shards.json").exists()


@pytest.mark.timeout(120)
def test_split_of_an_fp32_checkpoint_names_the_dtype_it_needs_and_writes_nothing(tmp_path, capsys):
    # the refusal said "the config says torch.bfloat16" of a config that says float32
    _, full = write_checkpoint(tmp_path, "dense_untied", torch_dtype="float32")
    save_file({n: t.float() for n, t in full.items()}, str(tmp_path / "full.safetensors"))
    rc, err = run_in_process(
        capsys,
        *("--config", str(tmp_path / "config.json")),
        *("--checkpoint", str(tmp_path / "full.safetensors")),
        *("--tp", "2", "--out", str(tmp_path / "out")),
    )
    assert rc == 2 and "LayoutError" in err and "is torch.float32" in err, err
    assert "engines are synced in torch.bfloat16" in err and "config says" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["fifo checkpoint", "out is a file", "out under a file"])
def test_split_inputs_and_outputs_that_are_not_what_they_should_be_are_named(
    tmp_path, capsys, case
):
    # a FIFO blocked the loader forever; an --out that cannot be a directory was a traceback
    write_checkpoint(tmp_path, "dense_tied")
    ckpt, out = tmp_path / "full.safetensors", tmp_path / "out"
    if case == "fifo checkpoint":
        ckpt = tmp_path / "fifo.safetensors"
        os.mkfifo(ckpt)
    else:
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" if case == "out is a file" else tmp_path / "afile" / "sub"
    argv = ["--config", str(tmp_path / "config.json"), "--checkpoint", str(ckpt)]
    rc, err = run_in_process(capsys, *argv, "--engine", "vllm", "--tp", "2", "--out", str(out))
    assert rc == 2 and err.startswith("deltasync: error: LayoutError: "), err
    assert ("not a regular file" if case == "fifo checkpoint" else str(out)) in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("listing", ["[]", '[{"id": "tp0", "tp_rank": Infinity, "ep_rank": 0}]'])
def test_merge_of_a_listing_with_no_shard_or_a_rank_out_of_range_is_named(
    tmp_path, capsys, listing
):
    write_checkpoint(tmp_path, "dense_tied")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "shards.json").write_text(listing)
    argv = ["layout", "merge", "--config", str(tmp_path / "config.json"), "--shards", str(shards)]
    rc = main([*argv, "--out", str(tmp_path / "m.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("deltasync: error: LayoutError: "), err
    assert "shards.json" in err


def _split_into(
    capsys, tmp_path: Path, ckpt: Path, out: Path, config: Path | None = None
) -> tuple[int, str]:
    config = tmp_path / "config.json" if config is None else config
    argv = ["--config", str(config), "--checkpoint", str(ckpt)]
    return run_in_process(capsys, *argv, "--engine", "vllm", "--tp", "2", "--out", str(out))


def _merge(capsys, tmp_path: Path, shards: Path, out: Path | None = None) -> tuple[int, str]:
    """``layout merge`` of ``shards`` into ``out`` (default ``merged.safetensors``)."""
    out = tmp_path / "merged.safetensors" if out is None else out
    argv = ["layout", "merge", "--config", str(tmp_path / "config.json"), "--shards", str(shards)]
    rc = main([*argv, "--out", str(out)])
    return rc, capsys.readouterr().err


def _second_checkpoint(tmp_path: Path, spec: ModelSpec, full: dict) -> Path:
    """Another checkpoint of the same model whose replicated tensors (norms) are the first's:
    a merge's replica check cannot tell the two apart."""
    other = random_state(spec, seed=32)
    other = {n: full[n] if "norm" in n else t for n, t in other.items()}
    save_file(other, str(tmp_path / "other.safetensors"))
    return tmp_path / "other.safetensors"


@pytest.mark.timeout(120)
def test_a_split_that_stops_part_way_over_an_earlier_one_leaves_nothing_merge_accepts(
    tmp_path, capsys, monkeypatch
):
    # The disk filled on the second shard file of a re-split: the new tp0 beside the earlier
    # split's tp1 and listing, which merge joined into a checkpoint that was neither (rc 0).
    import errno

    import safetensors.torch

    spec, full = write_checkpoint(tmp_path, "dense_untied")
    out = tmp_path / "out"
    assert _split_into(capsys, tmp_path, tmp_path / "full.safetensors", out)[0] == 0
    real, calls = safetensors.torch.save_file, []

    def fills_up(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", fills_up)
    rc, err = _split_into(capsys, tmp_path, _second_checkpoint(tmp_path, spec, full), out)
    assert rc == 2 and "No space left" in err, err
    monkeypatch.undo()
    rc, err = _merge(capsys, tmp_path, out)
    assert rc == 2 and "shards.json" in err, err
    assert not (tmp_path / "merged.safetensors").exists()


@pytest.mark.timeout(120)
def test_merge_refuses_shard_files_of_two_splits(tmp_path, capsys):
    spec, full = write_checkpoint(tmp_path, "dense_untied")
    first, second = tmp_path / "first", tmp_path / "second"
    assert _split_into(capsys, tmp_path, tmp_path / "full.safetensors", first)[0] == 0
    other = _second_checkpoint(tmp_path, spec, full)
    assert _split_into(capsys, tmp_path, other, second)[0] == 0
    (second / "tp1.safetensors").write_bytes((first / "tp1.safetensors").read_bytes())
    rc, err = _merge(capsys, tmp_path, second)
    assert rc == 2 and "different splits" in err and "deltasync_split" in err, err
    assert not (tmp_path / "merged.safetensors").exists()
    (second / "tp1.safetensors").unlink()  # split again: merges back bitwise
    assert _split_into(capsys, tmp_path, other, second)[0] == 0
    assert _merge(capsys, tmp_path, second)[0] == 0
    merged, want = load_file(str(tmp_path / "merged.safetensors")), load_file(str(other))
    assert merged.keys() == want.keys() and all(bitwise_equal(merged[n], want[n]) for n in want)


@pytest.mark.timeout(120)
def test_merge_refuses_shard_files_put_under_each_others_names(tmp_path, capsys):
    # TP ranks' files have the same tensor names and shapes, and the only replicated tensors
    # (the norms) agree: swapped files merged into another checkpoint (rc 0).
    write_checkpoint(tmp_path, "dense_untied")
    out = tmp_path / "out"
    assert _split_into(capsys, tmp_path, tmp_path / "full.safetensors", out)[0] == 0
    tp0, tp1 = (out / "tp0.safetensors").read_bytes(), (out / "tp1.safetensors").read_bytes()
    (out / "tp0.safetensors").write_bytes(tp1)
    (out / "tp1.safetensors").write_bytes(tp0)
    rc, err = _merge(capsys, tmp_path, out)
    assert rc == 2 and "tp0.safetensors' holds shard 'tp1', not 'tp0'" in err, err
    assert not (tmp_path / "merged.safetensors").exists()

    (out / "tp0.safetensors").write_bytes(tp0)
    (out / "tp1.safetensors").write_bytes(tp1)
    rc, err = _merge(capsys, tmp_path, out, out / "tp1.safetensors")  # over its own input
    assert rc == 2 and "is one of the shard files it merges" in err, err
    assert (out / "tp1.safetensors").read_bytes() == tp1
    rc, err = _merge(capsys, tmp_path, out)
    merged = load_file(str(tmp_path / "merged.safetensors"))
    full = load_file(str(tmp_path / "full.safetensors"))
    assert rc == 0 and all(bitwise_equal(merged[n], full[n]) for n in full), err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("node", ["fifo", "directory"])
def test_an_out_that_is_not_a_file_is_refused_and_left_as_it_was(tmp_path, capsys, node):
    # `--out /dev/null` run as root replaced the machine's null device with a regular file
    write_checkpoint(tmp_path, "dense_untied")
    shards = tmp_path / "shards"
    assert _split_into(capsys, tmp_path, tmp_path / "full.safetensors", shards)[0] == 0
    target = tmp_path / "target"
    if node == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    before = os.lstat(target)
    rc, err = _merge(capsys, tmp_path, shards, target)
    assert rc == 2 and err.startswith(
        "deltasync: error: LayoutError: cannot write merged checkpoint"
    ), err
    assert "not a file to replace" in err, err
    after = os.lstat(target)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no temp file left


@pytest.mark.timeout(60)
def test_a_path_too_long_to_look_at_is_a_typed_error(tmp_path, capsys):
    write_checkpoint(tmp_path, "dense_untied")
    too_long = tmp_path / ("s" * 300)
    for config, ckpt in (
        (too_long / "config.json", tmp_path / "full.safetensors"),
        (tmp_path / "config.json", too_long / "full.safetensors"),
    ):
        rc, err = _split_into(capsys, tmp_path, ckpt, tmp_path / "out", config)
        assert rc == 2 and err.startswith("deltasync: error: LayoutError: cannot read"), err
        assert "File name too long" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_an_out_that_is_a_symlink_becomes_the_file_and_its_target_is_left_alone(tmp_path, capsys):
    # e.g. a Hugging Face cache snapshot's model.safetensors -> ../../blobs/<sha>
    write_checkpoint(tmp_path, "dense_untied")
    shards = tmp_path / "shards"
    assert _split_into(capsys, tmp_path, tmp_path / "full.safetensors", shards)[0] == 0
    (tmp_path / "blob").write_bytes(b"kept")
    link = tmp_path / "snapshot.safetensors"
    link.symlink_to(tmp_path / "blob")
    rc, err = _merge(capsys, tmp_path, shards, link)
    assert rc == 0, err
    assert not link.is_symlink() and (tmp_path / "blob").read_bytes() == b"kept"
    merged, full = load_file(str(link)), load_file(str(tmp_path / "full.safetensors"))
    assert all(bitwise_equal(merged[n], full[n]) for n in full)


def test_split_and_merge_write_files_an_engine_of_another_user_may_read_as_the_umask_allows(
    tmp_path, capsys
):
    write_checkpoint(tmp_path, "dense_tied")
    old = os.umask(0o022)
    try:
        rc, err = run_in_process(
            capsys,
            *("--config", str(tmp_path / "config.json"), "--checkpoint"),
            *(str(tmp_path / "full.safetensors"), "--tp", "2", "--out", str(tmp_path / "sp")),
        )
        assert rc == 0, err
        config, shards = str(tmp_path / "config.json"), str(tmp_path / "sp")
        out = str(tmp_path / "merged.safetensors")
        rc = main(["layout", "merge", "--config", config, "--shards", shards, "--out", out])
        assert rc == 0, capsys.readouterr().err
    finally:
        os.umask(old)
    for path in [*sorted((tmp_path / "sp").glob("*.safetensors")), tmp_path / "merged.safetensors"]:
        assert path.stat().st_mode & 0o777 == 0o644, (path.name, oct(path.stat().st_mode))
