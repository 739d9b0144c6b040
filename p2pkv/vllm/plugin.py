"""A vLLM general plugin (entry point `vllm.general_plugins`): vLLM removed its `P2pNcclConnector`, so a launch
script that names it without `kv_connector_module_path` fails with "Unsupported connector type". With p2pkv
installed, that name resolves to p2pkv's connector, and such a script runs unchanged. vLLM loads general plugins
in each of its processes, and may load them more than once: registering is done once per process, and a name
already registered (by vLLM itself, should it ever ship that name again) is left alone."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
CONNECTOR = "P2pNcclConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR, "p2pkv.vllm", CONNECTOR)
    except ValueError:  # registered already: by this plugin earlier in this process, or by vLLM
        log.debug("kv_connector %s is registered already; left as it is", CONNECTOR)
