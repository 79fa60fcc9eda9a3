"""torch.distributed.elastic rendezvous over etcd v3: the state lives in one etcd
key, and every update is a transaction on that key's modification revision, so
two agents can never both move the rendezvous on from the same state."""
from __future__ import annotations

import grpc
from pyetcd import Etcd3Exception
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (DynamicRendezvousHandler, RendezvousBackend,
                                                                     create_handler)

from bamboo.control.etcd import EtcdLost, connect, retry
from bamboo.control.protocol import rendezvous_prefix
from bamboo.control.store import EtcdStore


PATIENCE = 20.0  # seconds a request is tried again while etcd (or, of several members, the one asked) is away


class EtcdRendezvousBackend(RendezvousBackend):
    def __init__(self, client, key: str, endpoints: str = "etcd"):
        self.client, self.key = client, key
        self._etcd = lambda fn: retry(fn, PATIENCE, endpoints)  # a dead member: the client moves to another

    @property
    def name(self) -> str:
        return "bamboo-etcd-v3"

    def get_state(self):
        try:
            value, meta = self._etcd(lambda: self.client.get(self.key))
        except (EtcdLost, Etcd3Exception, ValueError, grpc.RpcError) as e:  # ValueError: an endpoint marked failed
            raise RendezvousConnectionError(f"etcd unreachable: {type(e).__name__}") from e
        return None if value is None else (value, meta.mod_revision)

    def set_state(self, state: bytes, token=None):
        tx = self.client.transactions
        guard = tx.version(self.key) == 0 if token is None else tx.mod(self.key) == int(token)
        try:
            # tried again safely: the guard fails a second apply, and torch reads the state anew
            ok, _ = self._etcd(lambda: self.client.transaction(compare=[guard], success=[tx.put(self.key, state)],
                                                               failure=[]))
        except (EtcdLost, Etcd3Exception, ValueError, grpc.RpcError) as e:
            raise RendezvousConnectionError(f"etcd unreachable: {type(e).__name__}") from e
        current = self.get_state()
        if current is None:
            return None
        return current[0], current[1], ok


def rendezvous_handler(endpoint: str, run_id: str, min_nodes: int, max_nodes: int,
                       **options) -> DynamicRendezvousHandler:
    """torch elastic's dynamic rendezvous, with its state and its store in etcd."""
    client = connect(endpoint)
    store = EtcdStore(client, rendezvous_prefix(run_id) + "store", retry=lambda fn: retry(fn, PATIENCE, endpoint))
    backend = EtcdRendezvousBackend(client, rendezvous_prefix(run_id) + "state", endpoint)
    params = RendezvousParameters(backend=backend.name, endpoint=endpoint, run_id=run_id,
                                  min_nodes=min_nodes, max_nodes=max_nodes, **options)
    return create_handler(store, backend, params)
