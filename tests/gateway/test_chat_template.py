import json

import pytest

from services.gateway.tokenizer import ChatTemplateError, ModelTokenizer


def test_chat_is_rendered_with_the_models_template(tiny_model_dir):
    tok = ModelTokenizer(tiny_model_dir)
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there "}])
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 1  # bos written once, by the template


def test_template_errors_become_chat_template_errors(tmp_path, tiny_model_dir):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = ModelTokenizer(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tok.render_chat([{"role": "system", "content": "x"}])


def test_template_cannot_reach_python_internals(tmp_path, tiny_model_dir):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    config = {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError):
        ModelTokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])


def test_model_without_template_refuses_chat(tmp_path, tiny_model_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ModelTokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])
