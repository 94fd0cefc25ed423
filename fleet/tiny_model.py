"""``mooncake-tiny-model DIR``: a tiny Llama that real vLLM loads with no hub access.

Real engines need a model directory; downloading one is impossible on an offline machine and
pointless for testing cache routing, where only the token ids and the KV blocks matter. This
writes one from nothing, deterministically (the same bytes on every run and machine):

- a byte-level BPE tokenizer trained with HF ``tokenizers`` on a text file this package ships
  (any string tokenizes; no unknown tokens), with Llama-3-style special tokens;
- ``tokenizer_config.json`` with a chat template, so ``/v1/chat/completions`` works;
- ``config.json`` for ``LlamaForCausalLM`` within vLLM's CPU limits (head_dim >= 32);
- seeded random float32 weights in ``model.safetensors``;
- a PEFT LoRA adapter, ``tiny-sql``, in ``lora/tiny-sql/`` (rank 8 on ``q_proj`` and
  ``v_proj``, seeded non-zero weights: its answers and its KV blocks differ from the base
  model's), which vLLM serves with ``--enable-lora --lora-modules
  tiny-sql=DIR/lora/tiny-sql --max-lora-rank 8``.

The generated text is gibberish; the prefill, the prefix cache and the KV events are real.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from conductor.runtime import add_version_flag

CORPUS = Path(__file__).with_name("tiny_model_corpus.txt")
SEED = 20261123

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HEADER_START, HEADER_END, END_OF_TURN = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, HEADER_START, HEADER_END, END_OF_TURN]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

VOCAB_SIZE = 4096
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 32: vLLM's CPU attention needs at least 32
MAX_POSITIONS = 4096

LORA_NAME = "tiny-sql"
LORA_DIR = "lora"  # the model directory's subdirectory holding its adapters, one each
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")
LORA_SEED = SEED + 1
BASE_MODEL_NAME = "tiny-llama"  # the adapter's base_model_name_or_path: the name fleets serve


def train_tokenizer(corpus: Path = CORPUS) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so nothing is ever unknown."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.read_text(encoding="utf-8").splitlines(), trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def model_config(vocab_size: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def random_weights(vocab_size: int) -> dict[str, np.ndarray]:
    """Small seeded normals; ``RandomState``'s stream is frozen across numpy versions."""
    rng = np.random.RandomState(SEED)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    kv_width = KV_HEADS * HEAD_DIM
    weights = {"model.embed_tokens.weight": normal(vocab_size, HIDDEN)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        weights |= {
            f"{prefix}.self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.k_proj.weight": normal(kv_width, HIDDEN),
            f"{prefix}.self_attn.v_proj.weight": normal(kv_width, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            f"{prefix}.mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
            f"{prefix}.input_layernorm.weight": np.ones(HIDDEN, np.float32),
            f"{prefix}.post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        }
    weights["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    weights["lm_head.weight"] = normal(vocab_size, HIDDEN)
    return weights


def lora_weights() -> dict[str, np.ndarray]:
    """The adapter's A and B matrices under PEFT's names for a Llama. Both are non-zero
    (PEFT starts B at zero, an adapter that changes nothing), and large enough next to
    the base weights that the adapter's answers differ from the base model's."""
    rng = np.random.RandomState(LORA_SEED)
    out_features = {"q_proj": HEADS * HEAD_DIM, "v_proj": KV_HEADS * HEAD_DIM}
    weights: dict[str, np.ndarray] = {}
    for layer in range(LAYERS):
        for module in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = rng.standard_normal((LORA_RANK, HIDDEN)) * 0.1
            b = rng.standard_normal((out_features[module], LORA_RANK)) * 0.1
            weights[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
            weights[f"{prefix}.lora_B.weight"] = b.astype(np.float32)
    return weights


def lora_config() -> dict[str, Any]:
    """``adapter_config.json``: what PEFT writes for a plain LoRA (vLLM reads r,
    lora_alpha and target_modules, and rejects features it lacks)."""
    return {
        "base_model_name_or_path": BASE_MODEL_NAME,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": LORA_RANK,
        "target_modules": list(LORA_TARGETS),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def lora_adapter_dir(model_dir: Path) -> Path:
    """Where ``write_tiny_model`` puts the adapter: ``MODEL_DIR/lora/tiny-sql``."""
    return model_dir / LORA_DIR / LORA_NAME


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    LORA_DIR,
}


def write_tiny_model(directory: Path) -> Path:
    """Writes the model into ``directory`` whole: into a sibling first, renamed when
    complete, so an interrupted run never leaves a model that looks finished. An existing
    ``directory`` is replaced only when it holds nothing but a tiny model's files. One that
    another process renamed into place meanwhile (two fleets starting at once on a fresh
    machine) is whole, and may be read already: it is kept, and this copy dropped."""
    existed = directory.exists()
    if existed and not _holds_only_model_files(directory):
        raise FileExistsError(f"{directory} exists and is not a tiny model: not replacing it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        _write_files(partial)
        if existed:
            shutil.rmtree(directory)
        try:
            partial.rename(directory)  # onto a directory that is not empty: refused
        except OSError:
            if not _holds_only_model_files(directory):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return directory


def _holds_only_model_files(directory: Path) -> bool:
    return directory.is_dir() and {p.name for p in directory.iterdir()} <= MODEL_FILES


def _write_files(directory: Path) -> None:
    tokenizer = train_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(END_OF_TURN)
    assert bos_id is not None and eos_id is not None  # both are the tokenizer's special tokens
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": END_OF_TURN,
            "pad_token": EOS,
            "add_bos_token": True,
            "model_max_length": MAX_POSITIONS,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        directory / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": END_OF_TURN, "pad_token": EOS},
    )
    write_json(directory / "config.json", model_config(vocab_size, bos_id, eos_id))
    write_json(
        directory / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id}
    )
    save_file(random_weights(vocab_size), str(directory / "model.safetensors"))
    adapter = lora_adapter_dir(directory)
    adapter.mkdir(parents=True)
    write_json(adapter / "adapter_config.json", lora_config())
    save_file(lora_weights(), str(adapter / "adapter_model.safetensors"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mooncake-tiny-model",
        description="Write a tiny random-weight Llama (tokenizer, config, weights) that real "
        "vLLM loads offline, with a LoRA adapter for it in DIRECTORY/lora/tiny-sql (serve it "
        "with --enable-lora --lora-modules tiny-sql=DIRECTORY/lora/tiny-sql "
        "--max-lora-rank 8). Deterministic: the same bytes every run.",
    )
    parser.add_argument(
        "directory",
        type=Path,
        help="where to write it (replaces a tiny model there; refuses anything else)",
    )
    add_version_flag(parser)
    args = parser.parse_args(argv)
    try:
        directory = write_tiny_model(args.directory)
    except OSError as error:
        sys.exit(f"mooncake-tiny-model: {error}")
    print(f"tiny model written to {directory}")
    print(f"LoRA adapter {LORA_NAME} written to {lora_adapter_dir(directory)}")


if __name__ == "__main__":
    main()
