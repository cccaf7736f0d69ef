"""Content-addressed blob files: the name is the sha256 of the file, writes are atomic."""
from __future__ import annotations

import hashlib
import os

import pytest

from services.adapter_store.blobs import BlobStore, content_sha256, unpack_pair


def test_a_blob_is_named_by_the_sha256_of_its_own_bytes(tmp_path):
    blobs = BlobStore(tmp_path)
    sha = blobs.put(b'{"r":8}', b"weights" * 100)
    assert sha == content_sha256(b'{"r":8}', b"weights" * 100)
    assert hashlib.sha256(blobs.path(sha).read_bytes()).hexdigest() == sha
    assert blobs.read(sha) == (b'{"r":8}', b"weights" * 100)
    assert blobs.verify(sha) and blobs.list() == [sha]


def test_the_pair_boundary_is_part_of_the_identity(tmp_path):
    # Moving bytes from one file to the other must not give the same blob.
    assert content_sha256(b"ab", b"c") != content_sha256(b"a", b"bc")


def test_storing_the_same_content_again_does_not_rewrite_it(tmp_path):
    blobs = BlobStore(tmp_path)
    sha = blobs.put(b"{}", b"x")
    before = os.stat(blobs.path(sha)).st_ino
    assert blobs.put(b"{}", b"x") == sha
    assert os.stat(blobs.path(sha)).st_ino == before


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    blobs = BlobStore(tmp_path)

    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        blobs.put(b"{}", b"x")
    monkeypatch.undo()
    assert list(blobs.root.iterdir()) == []


def test_temp_files_of_a_crashed_write_are_cleared_and_not_listed(tmp_path):
    blobs = BlobStore(tmp_path)
    sha = blobs.put(b"{}", b"x")
    (blobs.root / f"{sha}.99.tmp").write_bytes(b"half")
    assert blobs.list() == [sha]
    assert blobs.remove_temp_files() == 1
    assert [p.name for p in blobs.root.iterdir()] == [sha]


def test_corrupt_blobs_are_detected(tmp_path):
    blobs = BlobStore(tmp_path)
    sha = blobs.put(b"{}", b"x")
    blobs.path(sha).write_bytes(b"LPXADPT1" + (10**9).to_bytes(8, "little"))
    assert not blobs.verify(sha)
    with pytest.raises(ValueError, match="corrupt"):
        unpack_pair(blobs.path(sha).read_bytes())
    with pytest.raises(ValueError, match="sha256"):
        blobs.path("../../etc/passwd")
