"""A tiny random Llama checkpoint in Hugging Face layout, for tests, demos and the embedded default.

The files are written directly (safetensors + JSON) rather than through `transformers`, which is only a
test dependency: the embedded server must be able to build its model without it. The config uses the
long-standing `rope_theta` / `rope_scaling` keys that every transformers release since 4.45 reads.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

# Ids fixed by position in the special-token list (Llama convention: unk 0, bos 1, eos 2).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
VOCAB_SIZE = 512

# Each message is "<|role|>\n content </s>\n"; a generation prompt ends with the assistant marker, so the
# model's reply is terminated by the same eos the engine stops on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

PRESETS: dict[str, dict] = {
    # Multi-head attention; intermediate 176 is on purpose not a multiple of 64 so kernels see ragged tiles.
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=16, rope_theta=10000.0, rope_scaling=None,
                 max_position_embeddings=2048),
    # Grouped-query attention with Llama-3 style rope scaling (original context 512, stretched 8x).
    "tiny-gqa": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
                     max_position_embeddings=4096),
}

# Linear weights are drawn at this std: large enough that logits differ clearly between prompts
# (greedy output depends on the input), small enough that fp16 never overflows.
WEIGHT_STD = 0.1
EMBED_STD = 1.0


def corpus_text() -> str:
    return resources.files("shared").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE trained on the bundled corpus; deterministic for a given corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    # Like Llama tokenizers: plain encoding prepends <s>; chat templates write it themselves and are
    # encoded without special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def hf_config(preset: str, vocab_size: int) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "initializer_range": WEIGHT_STD,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    cfg.update(p)
    if cfg["rope_scaling"] is None:
        del cfg["rope_scaling"]
    return cfg


def random_state_dict(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM parameter names and shapes ([out, in] for linears), random values, fp32."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]

    def normal(*shape, std=WEIGHT_STD):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    def norm_weight():
        # Near one, not exactly: a norm applied on the wrong side or skipped then changes the output.
        return (1.0 + 0.1 * torch.randn(h, generator=g)).contiguous()

    sd = {"model.embed_tokens.weight": normal(vocab, h, std=EMBED_STD)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_weight()
        sd[p + "self_attn.q_proj.weight"] = normal(q_dim, h)
        sd[p + "self_attn.k_proj.weight"] = normal(kv_dim, h)
        sd[p + "self_attn.v_proj.weight"] = normal(kv_dim, h)
        sd[p + "self_attn.o_proj.weight"] = normal(h, q_dim)
        sd[p + "post_attention_layernorm.weight"] = norm_weight()
        sd[p + "mlp.gate_proj.weight"] = normal(inter, h)
        sd[p + "mlp.up_proj.weight"] = normal(inter, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, inter, std=WEIGHT_STD * math.sqrt(h / inter))
    sd["model.norm.weight"] = norm_weight()
    sd["lm_head.weight"] = normal(vocab, h)
    return sd


def make_model(model_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a random tiny Llama checkpoint with tokenizer and chat template; returns the folder."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size()
    cfg = hf_config(preset, vocab_size)
    _write_json(out / "config.json", cfg)
    save_file(random_state_dict(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "additional_special_tokens": list(SPECIAL_TOKENS[4:]),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(out / "generation_config.json", {
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    })
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """`loraplex make-model`"""
    parser = argparse.ArgumentParser(
        prog="loraplex make-model",
        description="Write a tiny random Llama checkpoint (config, safetensors weights, tokenizer, chat template).",
    )
    parser.add_argument("dir", help="output folder (created if missing)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="tiny: multi-head attention; tiny-gqa: grouped-query attention with llama3 rope scaling")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    out = make_model(args.dir, preset=args.preset, seed=args.seed)
    sys.stdout.write(f"wrote {args.preset} model to {out}\n")
    return 0
