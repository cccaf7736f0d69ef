import pytest

from tests.gateway.peers import FakePeers, GatewayProcess


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    fake = FakePeers(tmp_path_factory.mktemp("peers"))
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def gateway(peers, tiny_model_dir, tmp_path_factory):
    gw = GatewayProcess(tmp_path_factory.mktemp("gateway"), tiny_model_dir, peers, max_model_len=64)
    gw.wait_ready()
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def fresh_peers(request):
    if "peers" in request.fixturenames:
        request.getfixturevalue("peers").reset()
