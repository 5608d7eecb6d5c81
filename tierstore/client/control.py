"""The engine's control channel to its host's sidecar: connect, attach, call.

Provides ``ControlChannel``. It opens a gRPC channel on the sidecar's Unix
socket (``SidecarUnavailable`` when nothing answers within the connect
timeout) and attaches: the sidecar's hello names this client, its arena and
its batch limit, and the Attach stream stays open for the client's life (its
end is the detach, when the sidecar drops the client's pins). Then ``call``
makes one control call within the call timeout (gRPC errors become
tierstore's, see ``rpc_error``): over the fast path when ``fast_calls`` is
set and serves it (reserve, commit, abort, acquire, release: the same
handler in the sidecar, without gRPC's cost), else over gRPC. ``request``
builds the keys request most calls take, and ``register`` tells the sidecar
about a layout, once per layout. ``before_call`` (the owner's hook: waiting
for releases in flight) runs before every call.

Runs in the engine process; ``call`` may be used from several threads. A
watcher thread ("tierstore-attach", started by ``watch``) follows the Attach
stream and clears ``connected`` when it ends.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from tierstore.client.fastpath import FastCalls
from tierstore.client.results import SidecarUnavailable, rpc_error
from tierstore.config.server import ServerConfig
from tierstore.errors import LayoutError
from tierstore.fastwire import CALL_CODES
from tierstore.keys import BlockKey, KVLayout
from tierstore.v1 import common_pb2, local_pb2, local_pb2_grpc

MAX_MESSAGE_BYTES = 4 << 20  # control messages only: block bytes go through the arena
RECONNECT_OPTIONS = (  # a local socket: cheap to try again soon
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class ControlChannel:
    """See the module docstring. Raises ``SidecarUnavailable`` (nothing
    answers) or a mapped RPC error (the attach failed); either way the
    channel is closed again."""

    def __init__(
        self,
        socket_path: str,
        *,
        name: str,
        connect_timeout_s: float,
        call_timeout_s: float,
        before_call: Callable[[], None],
    ) -> None:
        self.socket_path = socket_path
        self.call_timeout_s = call_timeout_s
        self._before_call = before_call
        self.channel = grpc.insecure_channel(
            f"unix:{socket_path}",
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # A sidecar still starting (an engine and its sidecar started
                # together) is asked again every 0.1 s, not after gRPC's 1 s
                # first backoff: the attach follows the sidecar's start by
                # 0.1 s at most (bench/tiers/restart.py's serve_ready_s).
                *RECONNECT_OPTIONS,
            ],
        )
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise SidecarUnavailable(
                f"no tierstore sidecar answers on unix:{socket_path} within "
                f"{connect_timeout_s}s; start one with `tierstore serve`"
            ) from None
        self.stub = local_pb2_grpc.LocalServiceStub(self.channel)
        self._attach = self.stub.Attach(
            local_pb2.AttachRequest(client_name=name or f"pid-{os.getpid()}", pid=os.getpid())
        )
        try:
            hello = next(self._attach)
        except grpc.RpcError as e:
            self.channel.close()
            raise rpc_error(e, "attach") from e
        self.client_id: int = hello.client_id
        self.max_batch_keys: int = hello.max_batch_keys or ServerConfig().max_batch_keys
        self.server_version: str = hello.server_version
        self.arena_path: str = hello.arena_path
        self.arena_bytes: int = hello.arena_bytes
        # Layouts registered with the sidecar, by fingerprint (read by the HBM
        # writer: dirty blocks are written down under their own layout).
        self.layouts: dict[bytes, KVLayout] = {}
        self.connected = True
        self._watcher: threading.Thread | None = None
        # The calls the fast path can make, by the stub's method (set by the owner).
        self.fast_calls: FastCalls | None = None
        self._fast_names = {getattr(self.stub, name): name for name in CALL_CODES}

    def watch(self) -> None:
        """Start following the Attach stream (once)."""
        self._watcher = threading.Thread(target=self._watch, name="tierstore-attach", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        try:
            for _ in self._attach:
                pass
        except grpc.RpcError:
            pass
        self.connected = False

    def call(self, method: Any, request: Any, what: str, extra_s: float = 0.0) -> Any:
        """``method(request)`` within the call timeout (plus ``extra_s``, for a
        call that waits on purpose), after ``before_call``."""
        self._before_call()
        timeout_s = self.call_timeout_s + extra_s
        fast, name = self.fast_calls, self._fast_names.get(method)
        if fast is not None and name is not None:
            reply = fast.call(name, request, timeout_s, what)
            if reply is not None:
                return reply
        try:
            return method(request, timeout=timeout_s)
        except grpc.RpcError as e:
            raise rpc_error(e, what) from e

    def request(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        include_peers: bool = False,
        deadline_s: float = 0.0,
    ) -> local_pb2.KeysRequest:
        return local_pb2.KeysRequest(
            client_id=self.client_id,
            layout_id=self.register(layout),
            keys=b"".join(keys),
            include_peers=include_peers,
            deadline_s=deadline_s,
        )

    def register(self, layout: KVLayout) -> bytes:
        """Tell the sidecar about a layout (once per layout). Returns its id."""
        fp = layout.fingerprint
        if fp not in self.layouts:
            reply = self.call(
                self.stub.RegisterLayout,
                local_pb2.RegisterLayoutRequest(layout=common_pb2.Layout(**layout.to_dict())),
                "register layout",
            )
            if reply.layout_id != fp:
                raise LayoutError(
                    "the sidecar computed another fingerprint for this layout: "
                    "client and server versions disagree"
                )
            self.layouts[fp] = layout
        return fp

    def close(self) -> None:
        """Detach: end the Attach stream, close the channel, let the watcher go."""
        if self.fast_calls is not None:
            self.fast_calls.close()
        self._attach.cancel()
        self.channel.close()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
