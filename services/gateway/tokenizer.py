"""The base model's tokenizer and chat template, read from its Hugging Face folder.

`tokenizer.json` is loaded with HF `tokenizers` (no `transformers` in the serving path); the chat template
comes from `tokenizer_config.json` and is rendered in a sandboxed jinja2 environment configured as
`transformers` does it, so prompts match what the model was trained on.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it."""


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


class ModelTokenizer:
    def __init__(self, model_dir: str | Path):
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the gateway needs the model's tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.special_tokens = {k: _token_text(v) for k, v in config.items()
                               if k.endswith("_token") and isinstance(_token_text(v), str)}
        self.chat_template = self._pick_template(config.get("chat_template"))
        self._compiled = None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _pick_template(value) -> str | None:
        if isinstance(value, list):  # named templates: the default one serves chat
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            return named.get("default")
        return value if isinstance(value, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json chat_template); use /v1/completions")
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.chat_template)
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template is user-supplied code: any failure is a refusal, not a crash
            raise ChatTemplateError(f"the chat template could not render these messages: {e}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template writes its own special tokens (bos): encoding must not add them a second time.
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _raise(message: str):
    raise ChatTemplateError(message)
