"""The benchmark settings of BENCHMARKS.md: a base model's shapes, the adapters' rank set and target modules.

S1, S2 and S4 are the S-LoRA paper's (Llama-2-7B and -13B shapes, q,k,v,o adapted); S-GQA is ours
(Llama-3-8B shapes, grouped-query attention, every linear adapted). Weights are random
(`loraplex up --dummy-weights`), so each setting carries the Hugging Face config.json of its base and is
served from a folder holding that config and a word-level tokenizer of the same vocabulary size: the
gateway needs a tokenizer.json, and the load client sends token ids, never text. "tiny" is the tiny test
model's shapes (shared/tiny_model.py) served the same way, so CPU tests take the path the GPU runs take.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench import write_file_atomically
from shared.model_config import MODULES, ModelConfig

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_MODULES = MODULES
ADAPTER_DTYPE_BYTES = 2  # adapters are written in bf16, as the paper's were fp16

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

LLAMA2_7B = {
    **_LLAMA, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
}
LLAMA2_13B = {
    **LLAMA2_7B, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
    "num_attention_heads": 40, "num_key_value_heads": 40,
}
LLAMA3_8B = {
    **_LLAMA, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def _tiny_config() -> dict:
    from shared.tiny_model import VOCAB_SIZE, hf_config

    return hf_config("tiny", VOCAB_SIZE)


@dataclass(frozen=True)
class Setting:
    name: str
    model: str  # folder name of the served base, which is also the base model's name in the API
    hf_config: dict
    ranks: tuple[int, ...]
    targets: tuple[str, ...]
    description: str = ""

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def is_tiny(self) -> bool:
        return self.name == "tiny"

    def adapter_params(self, rank: int) -> int:
        """Elements of one adapter of this rank: r·(in + out) per adapted module per layer."""
        cfg = self.model_config
        per_layer = sum(rank * sum(cfg.module_dims(m)) for m in self.targets)
        return per_layer * cfg.num_layers

    def adapter_bytes(self, rank: int) -> int:
        """Weight bytes of one bf16 adapter file of this rank (the safetensors header aside)."""
        return self.adapter_params(rank) * ADAPTER_DTYPE_BYTES

    @property
    def mean_rank(self) -> float:
        return sum(self.ranks) / len(self.ranks)

    def prepare_model(self, root: str | Path) -> Path:
        """The folder `loraplex up --dummy-weights` serves: config.json and a tokenizer of the vocabulary's size.

        Written once; an existing folder with the same config is left as it is.
        """
        folder = Path(root) / self.model
        config_path = folder / "config.json"
        if config_path.is_file() and (folder / "tokenizer.json").is_file():
            if json.loads(config_path.read_text()) == self.hf_config:
                return folder
        folder.mkdir(parents=True, exist_ok=True)
        write_word_tokenizer(folder, self.vocab_size)
        write_file_atomically(config_path, json.dumps(self.hf_config, indent=2) + "\n")
        return folder


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose ids are exactly 0..vocab_size-1 (token i is the word `t<i>`).

    Benchmarks send token ids and ignore EOS, so no merges are needed; what matters is that the gateway's
    vocabulary (which bounds the prompt ids it accepts) matches the model's, and that every generated id
    decodes to text.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Drivers on other GPUs of the host may write the same folder at once (bench sweep --gpus).
    write_file_atomically(folder / "tokenizer.json", write=lambda tmp: tok.save(str(tmp)))
    write_file_atomically(folder / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")


SETTINGS: dict[str, Setting] = {
    s.name: s for s in (
        Setting("S1", "llama-2-7b", LLAMA2_7B, (8,), ATTENTION, "Llama-2-7B shapes, rank 8, q,k,v,o (paper S1)"),
        Setting("S2", "llama-2-7b", LLAMA2_7B, (64, 32, 16, 8), ATTENTION,
                "Llama-2-7B shapes, ranks 64,32,16,8, q,k,v,o (paper S2)"),
        Setting("S4", "llama-2-13b", LLAMA2_13B, (64, 32, 16), ATTENTION,
                "Llama-2-13B shapes, ranks 64,32,16, q,k,v,o (paper S4)"),
        Setting("S-GQA", "llama-3-8b", LLAMA3_8B, (64, 32, 16, 8), ALL_MODULES,
                "Llama-3-8B shapes (GQA 32/8), ranks 64,32,16,8, all seven linears"),
        Setting("tiny", "tiny-llama", _tiny_config(), (8, 4, 2), ATTENTION,
                "the tiny test model's shapes, ranks 8,4,2, q,k,v,o (CPU tests)"),
    )
}


def get_setting(name: str) -> Setting:
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {name!r}; choose one of {', '.join(SETTINGS)}")
    return SETTINGS[name]
