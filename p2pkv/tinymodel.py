"""Writes a tiny Llama-architecture model (or a hybrid Mamba2 + attention one) that vLLM can load, with no network.

The weights are random but seeded, so every machine writes identical files; the tokenizer is byte-level
(one token per byte, no merges), so any text encodes and prompt lengths are easy to control in tests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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
    # Tokens of a sliding window on every other layer, from the first (0: every layer full attention): a hybrid
    # model, whose KV vLLM's hybrid KV cache manager keeps in two groups.
    sliding_window: int = 0
    # A Mamba2 mixer instead of attention on every other layer, from the first: a hybrid model (vLLM's
    # GraniteMoeHybridForCausalLM) whose Mamba state vLLM's hybrid KV cache manager keeps in a group of its own.
    # vLLM 0.32's CPU build serves it with prefix caching off only (with it on, its Mamba2 mixer fails).
    mamba: bool = False


# The Mamba2 mixers' shape: 2 * hidden_size channels in heads of 64, a state of 16 per channel, one group and a
# convolution over 4 tokens. Their state (about 10k numbers a layer at hidden_size 256) fits in one page of the
# attention layers' KV at vLLM's CPU block size (128 tokens), so the page does not grow for it.
_MAMBA_EXPAND = 2
_MAMBA_HEAD_DIM = 64
_MAMBA_D_STATE = 16
_MAMBA_D_CONV = 4


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


def _config(spec: TinyModelSpec, vocab_size: int, layers: int, arch: str) -> dict[str, object]:
    window: dict[str, object] = {}
    if spec.sliding_window:
        window = {"sliding_window": spec.sliding_window,
                  "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
    return {
        **window,
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
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


def _hybrid_config(spec: TinyModelSpec, vocab_size: int) -> dict[str, object]:
    """GraniteMoeHybrid with no experts: each layer is its mixer (Mamba2 or attention) then a gated MLP."""
    head_dim = spec.hidden_size // spec.num_heads
    mamba_channels = _MAMBA_EXPAND * spec.hidden_size
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "layer_types": ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)],
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "shared_intermediate_size": spec.intermediate_size,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rms_norm_eps": 1e-5,
        # Granite's attention takes its scale from here rather than from the head size.
        "attention_multiplier": head_dim**-0.5,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
        "mamba_n_heads": mamba_channels // _MAMBA_HEAD_DIM,
        "mamba_d_head": _MAMBA_HEAD_DIM,
        "mamba_n_groups": 1,
        "mamba_d_state": _MAMBA_D_STATE,
        "mamba_d_conv": _MAMBA_D_CONV,
        "mamba_expand": _MAMBA_EXPAND,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "vocab_size": vocab_size,
        "bos_token_id": vocab_size - 2,
        "eos_token_id": vocab_size - 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _hybrid_layer(index: int, spec: TinyModelSpec, rand: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch

    h, i = spec.hidden_size, spec.intermediate_size
    prefix = f"model.layers.{index}."
    out = {
        prefix + "input_layernorm.weight": torch.ones(h),
        prefix + "post_attention_layernorm.weight": torch.ones(h),
        prefix + "shared_mlp.input_linear.weight": rand(2 * i, h) / h**0.5,  # gate, then up
        prefix + "shared_mlp.output_linear.weight": rand(h, i) / i**0.5,
    }
    if index % 2:
        kv = spec.num_kv_heads * (h // spec.num_heads)
        return {**out,
                prefix + "self_attn.q_proj.weight": rand(h, h) / h**0.5,
                prefix + "self_attn.k_proj.weight": rand(kv, h) / h**0.5,
                prefix + "self_attn.v_proj.weight": rand(kv, h) / h**0.5,
                prefix + "self_attn.o_proj.weight": rand(h, h) / h**0.5}
    channels = _MAMBA_EXPAND * h
    heads = channels // _MAMBA_HEAD_DIM
    conv = channels + 2 * _MAMBA_D_STATE  # x, B and C pass through the convolution
    # Decay rates 1..heads (A = -exp(A_log)) and time steps from 0.01 to 0.1, within the ranges Mamba2's own
    # initialisation draws them from: random ones could make a head forget at once or hardly decay.
    steps = torch.logspace(-2, -1, heads)
    return {**out,
            prefix + "mamba.in_proj.weight": rand(2 * channels + 2 * _MAMBA_D_STATE + heads, h) / h**0.5,
            prefix + "mamba.conv1d.weight": rand(conv, 1, _MAMBA_D_CONV) / _MAMBA_D_CONV**0.5,
            prefix + "mamba.conv1d.bias": torch.zeros(conv),
            prefix + "mamba.A_log": torch.log(torch.arange(1, heads + 1, dtype=torch.float32)),
            prefix + "mamba.D": torch.ones(heads),
            prefix + "mamba.dt_bias": steps + torch.log(-torch.expm1(-steps)),  # softplus(dt_bias) == steps
            prefix + "mamba.norm.weight": torch.ones(channels),
            prefix + "mamba.out_proj.weight": rand(h, channels) / channels**0.5}


def _layer(prefix: str, spec: TinyModelSpec, rand: Callable[..., torch.Tensor],
           input_norm: bool = True) -> dict[str, torch.Tensor]:
    import torch

    h, i = spec.hidden_size, spec.intermediate_size
    kv = spec.num_kv_heads * (h // spec.num_heads)
    out = {
        prefix + "post_attention_layernorm.weight": torch.ones(h),
        prefix + "self_attn.q_proj.weight": rand(h, h) / h**0.5,
        prefix + "self_attn.k_proj.weight": rand(kv, h) / h**0.5,
        prefix + "self_attn.v_proj.weight": rand(kv, h) / h**0.5,
        prefix + "self_attn.o_proj.weight": rand(h, h) / h**0.5,
        prefix + "mlp.gate_proj.weight": rand(i, h) / h**0.5,
        prefix + "mlp.up_proj.weight": rand(i, h) / h**0.5,
        prefix + "mlp.down_proj.weight": rand(h, i) / i**0.5,
    }
    if input_norm:
        out[prefix + "input_layernorm.weight"] = torch.ones(h)
    return out


def _randn(spec: TinyModelSpec, seed: int) -> Callable[..., torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * spec.init_std

    return rand


def _written(out: Path, spec_json: str) -> bool:
    marker = out / MODEL_MARKER
    return marker.exists() and marker.read_text() == spec_json


def write_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model to out_dir (created if needed) and return its path. Idempotent for one spec."""
    from safetensors.torch import save_file

    if spec.mamba and spec.sliding_window:
        raise ValueError("a tiny model has Mamba layers or sliding-window layers, not both")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec_json = json.dumps({k: v for k, v in spec.__dict__.items() if k not in ("sliding_window", "mamba") or v},
                           sort_keys=True)
    if _written(out, spec_json):
        return out
    vocab_size = _write_tokenizer(out)
    config = (_hybrid_config(spec, vocab_size) if spec.mamba
              else _config(spec, vocab_size, spec.num_layers, "LlamaForCausalLM"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": vocab_size - 2, "eos_token_id": vocab_size - 1})
    )
    import torch

    rand = _randn(spec, spec.seed)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(vocab_size, spec.hidden_size),
        "model.norm.weight": torch.ones(spec.hidden_size),
        "lm_head.weight": rand(vocab_size, spec.hidden_size),
    }
    for i in range(spec.num_layers):
        tensors.update(_hybrid_layer(i, spec, rand) if spec.mamba else _layer(f"model.layers.{i}.", spec, rand))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / MODEL_MARKER).write_text(spec_json)
    return out


def write_tiny_eagle(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a one-layer EAGLE draft head for the tiny model of `spec` (seeded random weights; it shares the
    model's embedding and output head, as vLLM lets an EAGLE head without them do) and return its path: for
    speculative decoding with a draft model, `{"method": "eagle", "model": PATH, ...}`. Its layer holds KV of its own,
    after the model's. Idempotent for one spec."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec_json = json.dumps({"eagle": {k: v for k, v in spec.__dict__.items() if k != "mamba" or v}}, sort_keys=True)
    if _written(out, spec_json):
        return out
    vocab_size = len(_byte_vocab())
    (out / "config.json").write_text(json.dumps(_config(spec, vocab_size, 1, "EagleLlamaForCausalLM"), indent=2))
    rand = _randn(spec, spec.seed + 1)
    # The first (here the only) layer of an EAGLE head has no input norm; `fc` takes the token's embedding and the
    # model's hidden state side by side.
    tensors = {"fc.weight": rand(spec.hidden_size, 2 * spec.hidden_size) / (2 * spec.hidden_size) ** 0.5,
               **_layer("layers.0.", spec, rand, input_norm=False)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / MODEL_MARKER).write_text(spec_json)
    return out


def tiny_prompt(tag: str, length: int) -> str:
    """A prompt of exactly `length` tokens for the tiny model (one token per byte), unique to `tag` and the same on
    every machine: tests and measurements that must not share a cached prefix give each request its own tag."""
    rng = random.Random(tag)
    words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                     for _ in range(length))
    return (f"[{tag}] " + words)[:length]
