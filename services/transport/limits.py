"""How much of a state server its callers can hold, and for how long.

gRPC Python runs every call on a thread of one pool and waits on the peer with no
timeout of its own: a caller that stops sending, or stops reading, keeps its thread
until the deadline the caller itself chose. So a state server runs health checks and
refusals on a small pool of their own (:class:`OnPoolServicer`, :func:`refusal`): a probe is answered while every
handler thread is busy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

QUICK_THREADS = 2
"""Threads for health checks and refusals, which take microseconds each."""


class _OnPool:
    """A handler behaviour that gRPC runs on ``pool`` rather than on the server's own
    (gRPC's ``experimental_thread_pool`` hook, which it reads off the behaviour)."""

    def __init__(self, behavior: Callable[..., Any], pool: ThreadPoolExecutor) -> None:
        self._behavior = behavior
        self.experimental_thread_pool = pool
        self.experimental_non_blocking = getattr(behavior, "experimental_non_blocking", False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._behavior(*args, **kwargs)


class OnPoolServicer:
    """Every method of a generated-stub servicer, run on ``pool`` (for ``add_*_to_server``)."""

    def __init__(self, servicer: object, pool: ThreadPoolExecutor) -> None:
        self._servicer = servicer
        self._pool = pool

    def __getattr__(self, name: str) -> _OnPool:
        return _OnPool(getattr(self._servicer, name), self._pool)


def refusal(code: grpc.StatusCode, details: str, pool: ThreadPoolExecutor | None = None) -> grpc.RpcMethodHandler:
    """A handler that ends any call with ``code`` before reading its body, on ``pool``.

    Streaming on both sides whatever the method's shape: gRPC reads no request message
    for a streaming handler until it asks for one (for a unary one it receives and parses
    the whole message first), and a client of any shape sees only the status.
    """

    def abort(_requests: Iterator[bytes], context: grpc.ServicerContext) -> None:
        context.abort(code, details)  # raises: the call ends here

    return grpc.stream_stream_rpc_method_handler(abort if pool is None else _OnPool(abort, pool))
