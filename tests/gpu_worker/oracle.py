"""The correctness oracle: transformers + peft, one request at a time, plus helpers that make PEFT
adapters with random (nonzero) weights on disk."""
from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int, **lora_kwargs) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**lora_kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.normal_(std=0.3)
            elif "lora_B" in name:  # PEFT starts B at zero; a zero adapter would prove nothing
                p.normal_(std=0.3)
    model.save_pretrained(out_dir)
    return out_dir


class HFOracle:
    """Greedy decoding with the reference stack, caching one model per adapter."""

    def __init__(self, base_dir: Path, adapter_dirs: dict[str, Path]):
        self.base_dir = base_dir
        self.adapter_dirs = adapter_dirs
        self._models: dict[str | None, torch.nn.Module] = {}

    def _model(self, adapter: str | None):
        if adapter not in self._models:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.base_dir, torch_dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, self.adapter_dirs[adapter])
            self._models[adapter] = model.eval()
        return self._models[adapter]

    @torch.no_grad()
    def greedy(self, prompt: list[int], adapter: str | None, steps: int) -> tuple[list[int], list[torch.Tensor]]:
        model = self._model(adapter)
        tokens, out, logits = list(prompt), [], []
        for _ in range(steps):
            row = model(torch.tensor([tokens])).logits[0, -1].float()
            token = int(row.argmax())
            logits.append(row)
            tokens.append(token)
            out.append(token)
        return out, logits
