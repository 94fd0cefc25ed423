"""``mooncake-tiny-model``: an offline Llama that vLLM's CPU backend accepts, byte-stable."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from fleet import tiny_model


def _digests(directory: Path) -> dict[str, str]:
    """Every file under ``directory``, by its relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in directory.rglob("*")
        if p.is_file()
    }


def test_the_same_bytes_every_run(tmp_path: Path) -> None:
    first = tiny_model.write_tiny_model(tmp_path / "a")
    result = subprocess.run(
        [sys.executable, "-m", "fleet.tiny_model", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert _digests(first) == _digests(tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no partial left
    tiny_model.write_tiny_model(first)  # over an existing one: replaced whole
    assert _digests(first) == _digests(tmp_path / "b")
    assert set(_digests(first)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "lora/tiny-sql/adapter_config.json",
        "lora/tiny-sql/adapter_model.safetensors",
    }


def test_within_vllm_cpu_limits_and_consistent(tmp_path: Path) -> None:
    directory = tiny_model.write_tiny_model(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] >= 32  # vLLM's CPU attention rejects smaller heads
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    weights = load_file(directory / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (config["vocab_size"], 128)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 128)
    assert len(weights) == 2 + 9 * config["num_hidden_layers"] + 1


def test_tokenizer_handles_any_text_and_has_a_chat_template(tmp_path: Path) -> None:
    directory = tiny_model.write_tiny_model(tmp_path)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == tiny_model.VOCAB_SIZE
    text = "Routers send prompts to the engine holding their prefix — ünïcødé, 中文, 🙂."
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == tokenizer.token_to_id(tiny_model.BOS)
    assert tokenizer.decode(encoding.ids) == text  # byte-level: nothing is unknown
    assert len(encoding.ids) < len(text.encode())  # merges learned from the corpus
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in config["chat_template"]
    assert config["bos_token"] == tiny_model.BOS


def test_a_directory_that_is_not_a_tiny_model_is_never_replaced(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    result = subprocess.run(
        [sys.executable, "-m", "fleet.tiny_model", str(precious)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "exists and is not a tiny model" in result.stderr
    assert [p.name for p in precious.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]  # no partial left


def test_the_lora_adapter_fits_the_model_as_peft_lays_it_out(tmp_path: Path) -> None:
    """PEFT's names and shapes for a Llama: A is (r, in), B is (out, r), on q_proj and
    v_proj of every layer; B is not PEFT's initial zeros, so the adapter changes answers."""
    directory = tiny_model.write_tiny_model(tmp_path / "model")
    adapter = tiny_model.lora_adapter_dir(directory)
    assert adapter == directory / "lora" / tiny_model.LORA_NAME
    config = json.loads((directory / "config.json").read_text())
    peft = json.loads((adapter / "adapter_config.json").read_text())
    assert {k: peft[k] for k in ("r", "target_modules", "peft_type", "task_type")} == {
        "r": 8,
        "target_modules": ["q_proj", "v_proj"],
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
    }
    assert peft["lora_alpha"] > 0 and peft["base_model_name_or_path"]
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    out_features = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    weights = load_file(adapter / "adapter_model.safetensors")
    expected = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in out_features.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            expected[f"{prefix}.lora_A.weight"] = (8, hidden)
            expected[f"{prefix}.lora_B.weight"] = (out, 8)
    assert {name: weight.shape for name, weight in weights.items()} == expected
    assert all(weight.dtype == np.float32 and np.all(weight != 0) for weight in weights.values())
    assert all(np.abs(weight).max() < 1 for weight in weights.values())


def test_a_model_another_process_wrote_meanwhile_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fleets starting at once on a fresh machine both write the model: the one that
    renames its copy into place second keeps the first one's (which the first fleet's
    engines may be reading), and leaves no partial copy behind."""
    target = tmp_path / "tiny-model"
    write_files = tiny_model._write_files

    def while_another_process_finishes(partial: Path) -> None:
        write_files(partial)
        monkeypatch.setattr(tiny_model, "_write_files", write_files)
        tiny_model.write_tiny_model(target)  # the other process, done first
        (target / "config.json").touch()  # marks its copy: it must stay in place
        os.utime(target / "config.json", (1, 1))

    monkeypatch.setattr(tiny_model, "_write_files", while_another_process_finishes)
    assert tiny_model.write_tiny_model(target) == target
    assert (target / "config.json").stat().st_mtime == 1  # the other process's copy
    assert {p.name for p in target.iterdir()} == tiny_model.MODEL_FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-model"]  # no partial left
