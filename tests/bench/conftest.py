"""Fixtures of the bench tests: a real `loraplex up` stack (tests.e2e's launcher subprocess: embedded tiny
model, its four demo adapters demo-000..demo-003, redis-server, every service a process, real HTTP), its
services on one intra-op thread each as the reliability tests run them (several times faster on a small
shared machine). Early abort is off so a slow CI machine cannot turn a test's request into a refusal."""
from __future__ import annotations

import pytest

from tests.reliability.conftest import Stack

DEMO_ADAPTERS = ("demo-000", "demo-001", "demo-002", "demo-003")
BASE_MODEL = "model"  # the embedded default model's served name


def demo_model_for(request) -> str:
    """A trace request's model on the core stack: adapter i -> demo-00i, None -> the base model."""
    return BASE_MODEL if request.adapter is None else DEMO_ADAPTERS[request.adapter]


@pytest.fixture(scope="session")
def core_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-core-stack")
    s = Stack(root / "data", "--set", "scheduler.first_token_slo_s=0", "--drain-timeout-s", "5")
    try:
        s.start()
        yield s
    finally:
        s.stop()
        s.kill_everything()
