"""The vLLM plugin p2pkv installs: `"kv_connector": "P2pNcclConnector"` without `kv_connector_module_path` (an old
launch script, unchanged) resolves to p2pkv's connector in a vLLM process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the plugin registers with vLLM's connector factory")

_CHECK = """
import sys
import p2pkv.vllm
assert "p2pkv.vllm.connector" not in sys.modules, "loading the plugin must not import the connector"
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

old_script = KVTransferConfig(kv_connector="P2pNcclConnector", kv_role="kv_producer")
try:
    KVConnectorFactory.get_connector_class(old_script)
except ValueError as exc:
    print("before:", exc)
load_general_plugins()
assert "p2pkv.vllm.connector" not in sys.modules, "registering must not import the connector either"
cls = KVConnectorFactory.get_connector_class(old_script)
print("after:", cls.__module__, cls.__name__)
from p2pkv.vllm.plugin import register
register()  # vLLM may load plugins again, in the same process: harmless
assert KVConnectorFactory.get_connector_class(old_script) is cls
"""


def test_the_old_connector_name_resolves_to_p2pkv_once_vllm_loads_its_plugins() -> None:
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "before: Unsupported connector type: P2pNcclConnector" in out.stdout
    assert "after: p2pkv.vllm.connector P2pNcclConnector" in out.stdout
