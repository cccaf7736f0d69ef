"""Refusals the store answers with; each becomes a StoreError reply (errors as data, the store keeps serving)."""
from __future__ import annotations


class StoreRefusal(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


def bad_request(code: str, message: str, param: str | None = None) -> StoreRefusal:
    return StoreRefusal(400, code, message, param)


def not_found(what: str, param: str = "name") -> StoreRefusal:
    return StoreRefusal(404, "adapter_not_found", f"adapter {what!r} does not exist", param)
