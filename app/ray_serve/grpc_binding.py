"""Where a replica's inter-deployment gRPC server listens (docs/operations.md, "Scale-out on Ray").

Ray Serve 2.60 starts it in every replica, the ingress's too, on all interfaces (``"[::]:0"`` in
ray/serve/_private/replica.py); handles reach it at the replica's node address and that port. mmserve's
deployments bind it to that node address instead: 127.0.0.1 on the one-machine cluster ``mmserve ray
serve`` starts, so nothing of it listens beyond loopback, and the node's own address on a cluster,
where the other nodes' handles connect to it. Called from both deployments' constructors, which Ray
runs before it starts the server."""

from __future__ import annotations

from typing import Any

import ray
from ray.serve._private import replica as serve_replica

ALL_INTERFACES = "[::]:"


def bind_to_node_address() -> None:
    """From now on, in this process, Ray Serve's ``"[::]:port"`` becomes ``"<node address>:port"``."""
    add_port = serve_replica.add_port_to_grpc_server
    if getattr(add_port, "binds_node_address", False):
        return
    node = ray.util.get_node_ip_address()
    host = f"[{node}]" if ":" in node else node

    def add_port_on_node(server: Any, address: str) -> int:
        if address.startswith(ALL_INTERFACES):
            address = host + ":" + address.removeprefix(ALL_INTERFACES)
        return int(add_port(server, address))

    add_port_on_node.binds_node_address = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port_on_node
