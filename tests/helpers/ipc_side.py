"""An engine over a host cache that exports it (cuda_ipc's stand-in: process_vm_readv) and pulls by reference."""

from __future__ import annotations

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.ipc import CacheAccess
from p2pkv.kv.staging import DeviceKv
from p2pkv.memory import HostPool
from p2pkv.params import Address
from tests.helpers.unit import caches


class Side:
    def __init__(self, fill: bool, transport: Transport = Transport.AUTO, exports: bool = True,
                 pull_over_device: bool = True, integrity: bool = False,
                 access: type[CacheAccess] = CacheAccess) -> None:
        self.layers = caches("LBHNC", fill)
        self.kv = DeviceKv(self.layers, 16, "test", 5)
        self.kv.pool = HostPool(1 << 20, pinned=False)
        self.buffers = TransferBuffers(self.kv)
        extra = ExtraConfig(kv_host="127.0.0.1", transfer_timeout_s=5, transport=transport,
                            pull_over_device=pull_over_device, integrity_check=integrity)
        self.access = access(self.kv)
        self.engine = TransferEngine(EngineSettings.from_config(extra, 0, 0), self.kv.digest,
                                     device=self.access if exports else None)
        self.engine.start()

    @property
    def address(self) -> Address:
        return Address.parse(self.engine.address)

    def pool_in_use(self) -> int:
        assert self.kv.pool is not None
        stats = self.kv.pool.stats()
        return 0 if stats is None else stats.bytes_in_use
