"""Server-sent events framing, as OpenAI streams: `data: <json>\n\n`, closed by `data: [DONE]`."""
from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"
