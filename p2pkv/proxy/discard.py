"""Telling an instance that a transfer's request will not come: its client went away after the prefill began
and before the decode answer. The decode instance frees the push when it arrives, and has a prefill instance
release blocks held for its pull; a prefill instance stops holding blocks for a pull nobody will make (its answer
went to nobody). Otherwise they would be held until they expire. The message is a request of one token whose
`kv_transfer_params` are `DiscardParams`, sent in the background (the client's request is over). Harmless if the
decode request did get there: the transfer is that request's, and the decode instance ignores the discard."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from p2pkv.errors import ConfigError
from p2pkv.params import DecodeParams, DiscardParams, parse_transfer_params
from p2pkv.proxy.instances import Instance
from p2pkv.proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)


def discard_of(returned: dict[str, Any] | None, transfer_id: str) -> DiscardParams:
    """The discard of a transfer: with the prefill instance's answer, where it holds the blocks, if it does."""
    try:
        params = parse_transfer_params(returned)
    except ConfigError:
        params = None
    return DiscardParams.of(params) if isinstance(params, DecodeParams) else DiscardParams(transfer_id)


class Discarder:
    def __init__(self, client: httpx.AsyncClient, metrics: ProxyMetrics, timeout_s: float) -> None:
        self.client = client
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()  # discards in flight

    def discard(self, instance: Instance, discard: DiscardParams, body: dict[str, Any],
                headers: dict[str, str]) -> None:
        """Send `instance` the discard, in the background; `body`: the client's request (its model is used)."""
        request: dict[str, Any] = {"prompt": [0], "max_tokens": 1, "kv_transfer_params": discard.to_dict()}
        if "model" in body:
            request["model"] = body["model"]
        task = asyncio.get_running_loop().create_task(self._send(instance, request, headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, instance: Instance, request: dict[str, Any], headers: dict[str, str]) -> None:
        tid = request["kv_transfer_params"]["transfer_id"]
        try:
            answer = await self.client.post(f"{instance.url}/v1/completions", json=request,
                                            headers=instance.headers(headers),
                                            timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            log.warning("transfer %s: instance %s was not told to free it: %r", tid, instance.name, exc)
            self.metrics.discards.labels("failed").inc()
            return
        if answer.status_code != 200:
            log.warning("transfer %s: instance %s answered %d to the discard", tid, instance.name,
                        answer.status_code)
        else:
            log.info("transfer %s: its client went away; instance %s frees it", tid, instance.name)
        self.metrics.discards.labels("sent" if answer.status_code == 200 else "refused").inc()
