"""Writes a tiny Llama-architecture model that vLLM can load, with no network.

The weights are random but seeded, so every machine writes identical files; the tokenizer is byte-level
(one token per byte, no merges), so any text encodes and prompt lengths are easy to control in tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Special tokens follow the 256 byte tokens.
_BOS = "<s>"
_EOS = "</s>"
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
MODEL_MARKER = "p2pkv-tiny-model.json"


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 4096
    seed: int = 1234
    # Larger than the usual 0.02 so logits are well separated and greedy decoding is stable.
    init_std: float = 0.25


def _byte_vocab() -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[_BOS] = len(vocab)
    vocab[_EOS] = len(vocab)
    return vocab


def _write_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = _byte_vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([_BOS, _EOS])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _BOS,
        "eos_token": _EOS,
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": _BOS, "eos_token": _EOS}))
    return len(vocab)


def write_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model to out_dir (created if needed) and return its path. Idempotent for one spec."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / MODEL_MARKER
    spec_json = json.dumps(spec.__dict__, sort_keys=True)
    if marker.exists() and marker.read_text() == spec_json:
        return out
    vocab_size = _write_tokenizer(out)
    head_dim = spec.hidden_size // spec.num_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "bos_token_id": vocab_size - 2,
        "eos_token_id": vocab_size - 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": vocab_size - 2, "eos_token_id": vocab_size - 1})
    )
    gen = torch.Generator().manual_seed(spec.seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * spec.init_std

    h, kv = spec.hidden_size, spec.num_kv_heads * head_dim
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(vocab_size, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rand(vocab_size, h),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
        tensors[p + "self_attn.q_proj.weight"] = rand(h, h) / h**0.5
        tensors[p + "self_attn.k_proj.weight"] = rand(kv, h) / h**0.5
        tensors[p + "self_attn.v_proj.weight"] = rand(kv, h) / h**0.5
        tensors[p + "self_attn.o_proj.weight"] = rand(h, h) / h**0.5
        tensors[p + "mlp.gate_proj.weight"] = rand(spec.intermediate_size, h) / h**0.5
        tensors[p + "mlp.up_proj.weight"] = rand(spec.intermediate_size, h) / h**0.5
        tensors[p + "mlp.down_proj.weight"] = rand(h, spec.intermediate_size) / spec.intermediate_size**0.5
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text(spec_json)
    return out
