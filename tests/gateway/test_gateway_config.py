import pytest

from services.gateway.config import GatewayConfig
from services.gateway.state import GatewayState


def test_unknown_keys_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="unknown GatewayConfig field"):
        GatewayConfig.from_dict({"model_dir": "m", "max_tokenz": 3})
    with pytest.raises(ValueError, match="max_body_bytes must be positive"):
        GatewayConfig(max_body_bytes=0)


def test_context_cannot_exceed_the_models_positions(tiny_model_dir):
    with pytest.raises(ValueError, match="exceeds the model's 2048 positions"):
        GatewayState(GatewayConfig(model_dir=str(tiny_model_dir), max_model_len=4096))
    state = GatewayState(GatewayConfig(model_dir=str(tiny_model_dir)))
    assert (state.max_model_len, state.base_name, state.stop_token_ids) == (2048, "model", [2])
    state.ctx.term()
