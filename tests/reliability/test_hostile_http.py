"""Hostile input through HTTP that the store-level table (tests/adapter_store/test_refusals.py) and the e2e
table (tests/e2e/test_bad_input.py) do not send: compression bombs and oversized or over-split multipart
bodies, safetensors whose header lies (lengths, shapes, offsets, dtypes), ranks above the server's maximum,
URL-encoded traversal in route paths and registration paths, absolute paths, hostile vLLM-alias names and
part filenames. Each is refused with a 4xx naming the problem; nothing is registered, no blob is written,
no file appears outside the data dir, and the server keeps its memory and keeps serving."""
from __future__ import annotations

import io
import json
import os
import shutil
import socket
import uuid
import zipfile
import zlib
from pathlib import Path

import pytest

from shared.make_adapters import make_adapters
from shared.probes import rss_mb
from tests.e2e.conftest import REPO
from tests.reliability.conftest import GENERAL_UPLOAD_CAP

MARK = "lpxevil"  # in every hostile name and path, so a file created anywhere from them can be searched for


def st_bytes(header, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file: 8-byte little-endian header length, JSON header, data (the length may lie)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


def multipart(config: bytes, weights: bytes, name: str = f"{MARK}-x", weights_filename: str = "adapter_model.safetensors"):
    return {"data": {"name": name},
            "files": {"adapter_config": ("adapter_config.json", config, "application/json"),
                      "adapter_model": (weights_filename, weights, "application/octet-stream")}}


def marked_files() -> list[str]:
    """Files named after MARK anywhere a traversal could have put them (never inside a data dir: blobs are
    named by their sha256)."""
    found = []
    for root in {Path("/tmp"), REPO, Path.cwd(), Path("/")}:
        try:
            entries = list(root.iterdir())
        except OSError:
            continue
        found += [str(p) for p in entries if MARK in p.name]
    for base in (Path("/tmp"), REPO):
        for path in base.glob(f"*/{MARK}*"):
            found.append(str(path))
    return sorted(set(found))


@pytest.fixture(scope="module")
def good(general_stack, tmp_path_factory) -> Path:
    return make_adapters(tmp_path_factory.mktemp("hostile-good"), general_stack.data_dir / "model", 1, ranks=[4],
                         seed=404, prefix="victim")[0]


@pytest.fixture
def unchanged(general_stack):
    """Asserts, after the test, that nothing was registered or stored and no marked file appeared."""
    stack = general_stack

    def state():
        with stack.client() as c:
            names = sorted(a["name"] for a in c.get("/v1/adapters").json()["data"])
        blobs = sorted(os.listdir(stack.data_dir / "blobs")) if (stack.data_dir / "blobs").is_dir() else []
        return names, blobs

    before = state()
    marked_before = marked_files()
    yield
    assert state() == before, "a refused request changed the registry or the blob store"
    assert marked_files() == marked_before, "a file named after hostile input appeared outside the data dir"


def refused(r, statuses=(400,)) -> dict:
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["message"] and err["code"], err
    return err


# ---- safetensors that lie ------------------------------------------------------------------------------

def _lying_weights(good: Path) -> dict[str, bytes]:
    real = (good / "adapter_model.safetensors").read_bytes()
    n = int.from_bytes(real[:8], "little")
    header = json.loads(real[8:8 + n])
    data = real[8 + n:]
    keys = sorted(k for k in header if k != "__metadata__")
    a_key = next(k for k in keys if "lora_A" in k)

    def edited(change) -> bytes:
        h = json.loads(json.dumps(header))
        change(h)
        return st_bytes(h, data)

    def two_share_bytes(h):
        first, second = keys[0], keys[1]
        h[second]["data_offsets"] = h[first]["data_offsets"]
        h[second]["shape"] = h[first]["shape"]
        h[second]["dtype"] = h[first]["dtype"]

    return {
        "header length past the end of the file": st_bytes(header, data, length=len(real) + 100),
        "header length of a terabyte": real[8:8 + n].join([(10**12).to_bytes(8, "little"), data]),
        "huge declared shape": edited(lambda h: h[a_key].update(shape=[1 << 31, 1 << 31])),
        "offsets beyond the data": edited(lambda h: h[a_key].update(data_offsets=[0, 1 << 40])),
        "shape and offsets disagree": edited(lambda h: h[a_key].update(shape=[h[a_key]["shape"][0] * 4, h[a_key]["shape"][1]])),
        "two tensors on the same bytes": edited(two_share_bytes),
        "unknown dtype": edited(lambda h: h[a_key].update(dtype="F128")),
        "negative dimension": edited(lambda h: h[a_key].update(shape=[-1, h[a_key]["shape"][1]])),
        "header is a list": st_bytes(b"[1, 2, 3]", data),
        "header is not json": st_bytes(b"\xff\xfe not json at all \x00", data),
        "metadata bomb": st_bytes({"__metadata__": {f"k{i}": "v" * 64 for i in range(20000)}}),
    }


LYING_CASES = ["header length past the end of the file", "header length of a terabyte", "huge declared shape",
               "offsets beyond the data", "shape and offsets disagree", "two tensors on the same bytes",
               "unknown dtype", "negative dimension", "header is a list", "header is not json", "metadata bomb"]


@pytest.mark.parametrize("case", LYING_CASES)
def test_safetensors_with_a_lying_header_is_refused(general_stack, good, unchanged, case):
    weights = _lying_weights(good)[case]
    config = (good / "adapter_config.json").read_bytes()
    with general_stack.client() as c:
        refused(c.post("/v1/adapters", **multipart(config, weights)), (400, 413))


def test_rank_above_the_servers_maximum_is_refused(general_stack, unchanged, tmp_path):
    big = make_adapters(tmp_path, general_stack.data_dir / "model", 1, ranks=[300], seed=405, prefix=MARK,
                        targets=["q_proj"])[0]
    with general_stack.client() as c:
        err = refused(c.post("/v1/adapters", **multipart((big / "adapter_config.json").read_bytes(),
                                                         (big / "adapter_model.safetensors").read_bytes())))
    assert "rank" in err["message"].lower()


# ---- bombs and oversized bodies ------------------------------------------------------------------------

def _zeros_deflated(total: int, wbits: int) -> bytes:
    comp = zlib.compressobj(9, zlib.DEFLATED, wbits)
    chunk = bytes(1 << 20)
    return b"".join(comp.compress(chunk) for _ in range(total >> 20)) + comp.flush()


def test_compressed_bodies_are_never_inflated(general_stack, good, unchanged):
    """A gzip-encoded multipart body that would inflate to 256 MB, and a zip archive posing as the
    safetensors file, each a few hundred KB on the wire: refused without inflating anything."""
    pids = general_stack.service_pids()
    before = {s: rss_mb(pids[s]) for s in ("gateway", "adapter_store")}
    config = (good / "adapter_config.json").read_bytes()
    bomb = _zeros_deflated(256 << 20, 16 + zlib.MAX_WBITS)  # gzip framing
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("adapter_model.safetensors", bytes(128 << 20))
    with general_stack.client() as c:
        boundary = "lpx" + uuid.uuid4().hex
        refused(c.post("/v1/adapters", content=bomb, headers={
            "content-type": f"multipart/form-data; boundary={boundary}", "content-encoding": "gzip"}), (400, 413, 415))
        refused(c.post("/v1/adapters", content=bomb, headers={"content-type": "application/json",
                                                              "content-encoding": "gzip"}), (400, 413, 415))
        refused(c.post("/v1/adapters", **multipart(config, archive.getvalue())), (400,))
        assert c.get("/health").status_code == 200
    after = {s: rss_mb(pids[s]) for s in before}
    assert all(after[s] - before[s] < 64 for s in before), (before, after)


def test_declared_body_beyond_the_cap_is_413_before_it_is_sent(general_stack):
    """Content-Length of a terabyte and no body at all: the answer comes at once, not after a read."""
    host, port = "127.0.0.1", general_stack.port
    for path, ctype in (("/v1/adapters", "multipart/form-data; boundary=x"), ("/v1/completions", "application/json")):
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n"
                      f"Content-Length: {10**12}\r\n\r\n".encode())
            reply = s.recv(4096).decode(errors="replace")
        assert reply.startswith("HTTP/1.1 413"), reply[:200]


def test_chunked_body_over_the_cap_is_413(general_stack, unchanged):
    def chunks():
        head = (b"--b\r\nContent-Disposition: form-data; name=\"adapter_model\"; filename=\"x\"\r\n"
                b"Content-Type: application/octet-stream\r\n\r\n")
        yield head
        for _ in range(2 * GENERAL_UPLOAD_CAP // 65536 + 2):
            yield bytes(65536)

    with general_stack.client() as c:
        refused(c.post("/v1/adapters", content=chunks(),
                       headers={"content-type": "multipart/form-data; boundary=b"}), (413,))


@pytest.mark.parametrize("fields, files", [(5000, 0), (0, 200), (3, 3)], ids=["many fields", "many files", "extra file"])
def test_multipart_with_too_many_parts_is_refused(general_stack, good, unchanged, fields, files):
    parts = [("name", (None, f"{MARK}-parts"))]
    parts += [(f"f{i}", (None, "v")) for i in range(fields)]
    parts += [("adapter_config", ("adapter_config.json", (good / "adapter_config.json").read_bytes()))]
    parts += [("adapter_model", ("adapter_model.safetensors", (good / "adapter_model.safetensors").read_bytes()))]
    parts += [(f"file{i}", (f"{MARK}{i}.bin", b"x")) for i in range(files)]
    with general_stack.client() as c:
        refused(c.post("/v1/adapters", files=parts))


# ---- names and paths ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [
    f"/v1/adapters/..%2F..%2F{MARK}", "/v1/adapters/%2e%2e", "/v1/adapters/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    f"/v1/adapters/%2F{MARK}", "/v1/adapters/..%252f..%252fetc", f"/v1/adapters/{MARK}%00x",
])
def test_url_encoded_traversal_in_route_paths_finds_nothing_and_deletes_nothing(general_stack, unchanged, path):
    with general_stack.client() as c:
        for method in ("GET", "DELETE"):
            r = c.request(method, path)
            refused(r, (400, 404))


@pytest.mark.parametrize("path", [
    f"%2e%2e/%2e%2e/{MARK}", f"..%2f..%2f{MARK}", "%2Fetc", "/etc/passwd", "/", "/proc/self/root/etc",
    f"file:///tmp/{MARK}", f"~/{MARK}", f"{MARK}\x00/../..", "\\\\server\\share",
])
def test_hostile_registration_paths_are_refused(general_stack, unchanged, path):
    with general_stack.client() as c:
        refused(c.post("/v1/adapters", json={"name": f"{MARK}-path", "path": path}), (400, 404))
        refused(c.post("/v1/load_lora_adapter", json={"lora_name": f"{MARK}-alias", "lora_path": path}), (400, 404))


def test_hostile_names_through_the_vllm_aliases_and_json_are_refused(general_stack, good, general_allowed_root, unchanged):
    inside = general_allowed_root / "hostile-names-good"
    if not inside.exists():
        shutil.copytree(good, inside)
    with general_stack.client() as c:
        for name in (f"../{MARK}", f"/tmp/{MARK}", f"%2e%2e%2f{MARK}", f"{MARK}/x", f"{MARK}\\..\\x"):
            refused(c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(inside)}))
            refused(c.post("/v1/unload_lora_adapter", json={"lora_name": name}), (400, 404))
        for name in (7, [f"{MARK}"], {"a": 1}, None):
            refused(c.post("/v1/adapters", json={"name": name, "path": str(inside)}))


def test_part_filenames_are_never_used_as_paths(general_stack, good, tmp_path):
    """Valid content under a filename that traverses: stored by content hash only, the filename ignored."""
    target = f"../../../../../../tmp/{MARK}-{uuid.uuid4().hex}.safetensors"
    before = marked_files()
    with general_stack.client() as c:
        r = c.post("/v1/adapters", **multipart((good / "adapter_config.json").read_bytes(),
                                               (good / "adapter_model.safetensors").read_bytes(),
                                               name="filename-trick", weights_filename=target))
        assert r.status_code in (200, 201), r.text
        try:
            assert marked_files() == before
            blob = general_stack.data_dir / "blobs"
            assert all(MARK not in p.name for p in blob.rglob("*"))
        finally:
            assert c.delete("/v1/adapters/filename-trick").status_code == 204
