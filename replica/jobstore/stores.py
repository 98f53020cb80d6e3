"""Where the job store is: one address string for every role and command.

* ``HOST:PORT`` (or ``tcp://HOST:PORT``): the embedded ``TCPStore`` the coordinator
  hosts; the single-machine default.
* ``etcd://H1:2379,H2:2379,H3:2379[/NAMESPACE]``: an etcd cluster (``replica.jobstore.etcd``);
  credentials and TLS files come from the environment (``REPLICA_ETCD_USER``,
  ``REPLICA_ETCD_PASSWORD``, ``REPLICA_ETCD_CA`` ...), never from the address, so the
  address can be logged and passed on the command line.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta

# TCPStore is torch.distributed's documented API, but torch/distributed/__init__.py imports it from the
# private torch._C._distributed_c10d without re-exporting it (no alias, no __all__): pyright calls it private.
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]
from torch.distributed.distributed_c10d import Store

from replica import envvars
from replica.jobstore.etcd import EtcdConfig, EtcdStore, parse_endpoints

__all__ = ["StoreAddress", "StoreKind"]


class StoreKind(enum.StrEnum):
    TCP = "tcp"
    ETCD = "etcd"


@dataclass(kw_only=True, frozen=True, slots=True)
class StoreAddress:
    kind: StoreKind
    endpoints: tuple[tuple[str, int], ...]
    namespace: str = ""  # etcd only: the prefix of the job's keys

    @classmethod
    def parse(cls, text: str) -> StoreAddress:
        scheme, sep, rest = text.strip().partition("://")
        if not sep:
            scheme, rest = "tcp", text.strip()
        if scheme == "tcp":
            host, colon, port = rest.rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"bad job store address {text!r}: expected HOST:PORT or etcd://HOST:PORT,...")
            return cls(kind=StoreKind.TCP, endpoints=((host, int(port)),))
        if scheme == "etcd":
            hosts, slash, namespace = rest.partition("/")
            if "@" in hosts:
                raise ValueError(
                    f"put etcd credentials in {envvars.ETCD_USER} / {envvars.ETCD_PASSWORD}, not the address"
                )
            namespace = namespace.strip("/")
            return cls(
                kind=StoreKind.ETCD,
                endpoints=parse_endpoints(hosts),
                namespace=f"{namespace}/" if namespace else "replica-job/",
            )
        raise ValueError(f"bad job store address {text!r}: the scheme must be tcp:// or etcd://")

    def __str__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        if self.kind == StoreKind.TCP:
            return hosts
        return f"etcd://{hosts}/{self.namespace.rstrip('/')}"

    @classmethod
    def of(cls, store: Store) -> StoreAddress:
        """The address of a store client (to hand to another process)."""
        if isinstance(store, EtcdStore):
            return cls(kind=StoreKind.ETCD, endpoints=store.config.endpoints, namespace=store.config.namespace)
        if isinstance(store, TCPStore):
            return cls(kind=StoreKind.TCP, endpoints=((store.host, store.port),))
        raise TypeError(f"{type(store).__name__} has no address another process could use")

    @property
    def host(self) -> str:
        return self.endpoints[0][0]

    @property
    def port(self) -> int:
        return self.endpoints[0][1]

    def connect(self, *, timeout: timedelta) -> Store:
        """A client of the store; ``timeout`` bounds its blocking waits."""
        if self.kind == StoreKind.TCP:
            return TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        return EtcdStore(
            EtcdConfig.from_environ(",".join(f"{h}:{p}" for h, p in self.endpoints), self.namespace, timeout=timeout)
        )
