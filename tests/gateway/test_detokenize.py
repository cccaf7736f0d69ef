from hypothesis import given, settings, strategies as st

from services.gateway.detokenize import REPLACEMENT, IncrementalDetokenizer
from services.gateway.tokenizer import ModelTokenizer


def stream(tok, ids, chunk=1):
    detok = IncrementalDetokenizer(tok.tokenizer)
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


def test_multibyte_characters_are_never_split(tiny_model_dir):
    tok = ModelTokenizer(tiny_model_dir)
    text = "héllo wörld ✓ 你好 🎉!"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)  # the tokenizer does split characters into bytes
    deltas, tail = stream(tok, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) + tail == text
    assert tail == ""


def test_special_tokens_are_skipped(tiny_model_dir):
    tok = ModelTokenizer(tiny_model_dir)
    ids = tok.encode("fox", add_special_tokens=True) + [2]  # <s> fox </s>
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == "fox"


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tiny_model_dir):
    tok = ModelTokenizer(tiny_model_dir)
    ids = tok.encode("ok 你", add_special_tokens=False)
    deltas, tail = stream(tok, ids[:-1])  # the last byte of 你 never comes
    assert "".join(deltas) == "ok " and tail == REPLACEMENT


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40), chunk=st.integers(1, 4))
def test_streamed_text_equals_whole_decode(tiny_model_dir, text, chunk):
    tok = ModelTokenizer(tiny_model_dir)
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = stream(tok, ids, chunk)
    assert all(not d.endswith(REPLACEMENT) for d in deltas)
    assert "".join(deltas) + tail == tok.decode(ids)
