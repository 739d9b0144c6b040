"""A vLLM request's p2pkv params: from its `kv_transfer_params`, or from the request id an old proxy gave it.

The old connector's proxy sent no `kv_transfer_params`; it named both instances' KV addresses in the request id
(`X-Request-Id`), which vLLM keeps inside its own id. Such a request is read as the params that id stands for, so
deployments that still run the old proxy keep their KV moving (`p2pkv.params.legacy_params`). A request with
`kv_transfer_params` of its own is read from those alone.

A router that speaks vLLM's standard disaggregation protocol (llm-d's sidecar, production-stack, vLLM's NIXL test
proxy) sends a prefill instance `do_remote_decode` without p2pkv's marker: that is a transfer too, held for the decode
side's pull, since the router names no decode instance (`p2pkv.params.standard_prefill`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from p2pkv.config import ConnectorConfig, Role, SendType
from p2pkv.errors import ConfigError
from p2pkv.params import (
    AnyParams,
    PrefillParams,
    legacy_params,
    parse_transfer_params,
    standard_prefill,
    standard_transfer_id,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class RequestParams:
    def __init__(self, config: ConnectorConfig) -> None:
        # An instance of both roles cannot tell from an old proxy's id which of the two it is asked to be.
        self._legacy_role = config.role if config.role is not Role.BOTH else None
        self._pull = config.extra.send_type is SendType.GET
        self._prefills = config.role is not Role.CONSUMER
        self._launch = config.launch

    def parse(self, request: Request) -> AnyParams | None:
        """The request's params; None for a request p2pkv has nothing to do with. ConfigError for invalid ones."""
        raw = request.kv_transfer_params
        params = parse_transfer_params(raw)
        if params is None and self._prefills and standard_prefill(raw):
            return PrefillParams(standard_transfer_id(self._launch, request.request_id), None, pull=True,
                                 standard=True)
        if params is None and self._legacy_role is not None:
            params = legacy_params(request.request_id, self._legacy_role is Role.PRODUCER,
                                   len(request.prompt_token_ids or ()), self._pull)
        return params

    def get(self, request: Request) -> AnyParams | None:
        """As `parse`, with invalid params logged and ignored (the request is computed as any other)."""
        try:
            return self.parse(request)
        except ConfigError as exc:
            log.error("request %s: ignoring invalid kv_transfer_params: %s", request.request_id, exc)
            return None
