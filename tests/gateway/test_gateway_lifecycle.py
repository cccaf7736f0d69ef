"""The gateway as a process: the openai client against it, and a graceful drain on SIGTERM."""
import signal
import threading
import time

import httpx
import numpy as np
import openai

from shared.wire import TokenOutput
from tests.gateway.peers import GatewayProcess


def script_text(ids, delay=0.0):
    def script(submit):
        return [(delay, TokenOutput(submit.request_id, np.array([t], np.int32), i == len(ids) - 1,
                                    "length" if i == len(ids) - 1 else None)) for i, t in enumerate(ids)]
    return script


def test_openai_client_completions_chat_and_streaming(gateway, peers):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    peers.script = script_text([337, 473, 439])  # "The quick"
    completion = client.completions.create(model="tiny", prompt="Say", max_tokens=3)
    assert completion.choices[0].text == "The quick" and completion.usage.completion_tokens == 3
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.content == "The quick" and chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The quick"
    assert chunks[-1].usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == ["tiny"]
    try:
        client.completions.create(model="missing", prompt="x")
    except openai.NotFoundError as e:
        assert e.body["code"] == "model_not_found"
    else:
        raise AssertionError("unknown model must be refused")


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(peers, tiny_model_dir, tmp_path):
    gw = GatewayProcess(tmp_path, tiny_model_dir, peers, max_model_len=64)
    try:
        gw.wait_ready()
        peers.script = script_text(list(range(10, 30)), delay=0.05)  # about one second of streaming
        result = {}

        def long_request():
            result["response"] = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 20}, timeout=20)

        worker = threading.Thread(target=long_request)
        worker.start()
        peers.wait_for(lambda: peers.submits)
        gw.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        r = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(gw.url + "/ready").status_code == 503
        worker.join(10)
        assert result["response"].status_code == 200
        assert result["response"].json()["usage"]["completion_tokens"] == 20
        assert gw.proc.wait(10) == 0
    finally:
        gw.stop()


def _get_on(sock, path: str) -> int:
    """One HTTP/1.1 GET on an open socket, read to the end of its body; the status, or 0 if the server had
    closed the connection."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1])


def test_an_idle_connection_stays_open_for_keep_alive_s_then_the_server_closes_it(peers, tiny_model_dir, tmp_path):
    import socket

    gw = GatewayProcess(tmp_path, tiny_model_dir, peers, keep_alive_s=2)
    try:
        gw.wait_ready()
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
            assert _get_on(sock, "/health") == 200
            time.sleep(1.0)  # idle, but under keep_alive_s: the same connection serves the next request
            assert _get_on(sock, "/health") == 200
            time.sleep(3.0)  # idle past keep_alive_s: the server has closed it
            sock.settimeout(2)
            assert sock.recv(1) == b""
    finally:
        gw.stop()
