"""A stub OpenAI backend for proxy benchmarks: answers at once, like a prefill or decode instance would.

    python -m p2pkv.bench.stub PORT
"""

from __future__ import annotations

import sys
from typing import Any

from fastapi import FastAPI, Request


def stub_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "stub"}]}

    @app.post("/v1/completions")
    async def complete(request: Request) -> dict[str, Any]:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        answer: dict[str, Any] = {"id": "cmpl-stub", "choices": [{"index": 0, "text": "ok"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        if params.get("do_remote_decode"):
            answer["kv_transfer_params"] = {"p2pkv": 1, "transfer_id": params["transfer_id"],
                                            "load_remote_kv": True, "num_prompt_tokens": 1}
        return answer

    return app


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(stub_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
