"""The benchmark settings: base shapes of the paper's models, rank sets, targets, and the folder served
with dummy weights (config.json plus a tokenizer whose vocabulary is the model's)."""
import json
import threading

import pytest
from tokenizers import Tokenizer

from bench.settings import SETTINGS, get_setting
from shared.model_config import ModelConfig


def parameters(cfg: ModelConfig) -> int:
    """Every weight of a Llama checkpoint, counted from its geometry."""
    h, i, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    attention = h * cfg.q_dim * 2 + h * cfg.kv_dim * 2
    return L * (attention + 3 * h * i + 2 * h) + 2 * v * h + h


@pytest.mark.parametrize("name,billions", [("S1", 6.74), ("S2", 6.74), ("S4", 13.02), ("S-GQA", 8.03)])
def test_paper_settings_have_the_published_model_sizes(name, billions):
    assert parameters(get_setting(name).model_config) / 1e9 == pytest.approx(billions, abs=0.01)


def test_rank_sets_and_targets_are_the_papers_and_ours():
    assert get_setting("S1").ranks == (8,)
    assert get_setting("S2").ranks == (64, 32, 16, 8)
    assert get_setting("S4").ranks == (64, 32, 16)
    for name in ("S1", "S2", "S4"):
        assert get_setting(name).targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    gqa = get_setting("S-GQA")
    assert gqa.ranks == (64, 32, 16, 8) and len(gqa.targets) == 7
    assert gqa.model_config.num_kv_heads == 8 and gqa.model_config.num_heads == 32


def test_adapter_bytes_follow_the_shapes():
    # Llama-2-7B, q,k,v,o: every module is 4096 x 4096, so r·(4096 + 4096) per module, 4 modules, 32 layers.
    assert get_setting("S2").adapter_bytes(30) == 30 * 8192 * 4 * 32 * 2
    # Llama-3-8B: k and v are 4096 -> 1024, gate/up 4096 -> 14336, down 14336 -> 4096.
    per_rank = (8192 + 5120 + 5120 + 8192 + 3 * 18432) * 32
    assert get_setting("S-GQA").adapter_params(16) == 16 * per_rank


@pytest.mark.parametrize("name", ["tiny", "S1"])
def test_prepared_model_folder_has_the_config_and_a_tokenizer_of_its_vocabulary(tmp_path, name):
    setting = get_setting(name)
    folder = setting.prepare_model(tmp_path)
    assert folder.name == setting.model
    assert json.loads((folder / "config.json").read_text()) == setting.hf_config
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == setting.vocab_size
    last = setting.vocab_size - 1
    assert tok.decode([5, last]) == f"t5 t{last}"
    # A second call leaves the folder as it is.
    before = (folder / "tokenizer.json").stat().st_mtime_ns
    setting.prepare_model(tmp_path)
    assert (folder / "tokenizer.json").stat().st_mtime_ns == before


def test_writers_preparing_one_folder_at_once_all_succeed_and_leave_it_whole(tmp_path):
    # Drivers on several GPUs of a host (bench sweep --gpus) prepare the same model folder side by side: one
    # writer's temporary file must never be renamed away under another.
    setting = get_setting("tiny")
    for round_ in range(5):
        root = tmp_path / f"round-{round_}"
        start, errors = threading.Barrier(6), []

        def prepare():
            start.wait()
            try:
                setting.prepare_model(root)
            except Exception as e:  # collected: a failure in a thread would not fail the test by itself
                errors.append(e)

        threads = [threading.Thread(target=prepare) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        folder = root / setting.model
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
        assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() == setting.vocab_size
        assert json.loads((folder / "config.json").read_text()) == setting.hf_config


def test_unknown_setting_names_the_choices():
    with pytest.raises(ValueError, match="S1, S2, S4, S-GQA, tiny"):
        get_setting("S3")
    assert set(SETTINGS) == {"S1", "S2", "S4", "S-GQA", "tiny"}
