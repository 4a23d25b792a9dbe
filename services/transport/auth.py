"""Who may call a state server: a shared bearer token in call metadata, checked by a
server interceptor, and optional mutual TLS. Health checks stay open so orchestrators
can probe liveness without the secret; they reveal nothing and change nothing.

A call without the token is refused before gRPC reads any of its body. The interceptor
sees only the method and the metadata; what gRPC reads next depends on the handler it
returns: for a handler taking one request it receives and parses the whole message
(up to the 32 MiB limit) before the handler runs, for a streaming one nothing until the
handler asks. So the refusal is always a streaming handler that never asks.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from cargohold.cluster.config import SecurityConfig
from cargohold.services.errors import ConfigError

AUTH_METADATA_KEY = "authorization"
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for mutual TLS: this end's certificate and key, and the CA that signed
    the other end's."""

    cert_file: str
    key_file: str
    ca_file: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return (
                Path(self.cert_file).read_bytes(),
                Path(self.key_file).read_bytes(),
                Path(self.ca_file).read_bytes(),
            )
        except OSError as error:
            raise ConfigError(f"cannot read TLS file {error.filename}: {error.strerror}") from error

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def tls_files(security: SecurityConfig) -> TlsFiles | None:
    """The mutual-TLS files ``security`` names; None when TLS is off."""
    if not security.tls_cert_file:
        return None
    return TlsFiles(
        cert_file=security.tls_cert_file, key_file=security.tls_key_file or "", ca_file=security.tls_ca_file or ""
    )


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates with ``token``."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call but health checks unless it carries ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ConfigError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        if handler_call_details.method in OPEN_METHODS:
            return continuation(handler_call_details)
        offered = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(offered.encode(), self._expected):
            return continuation(handler_call_details)
        # Not continuation(): a refused call goes no further, not even to find its handler.
        return refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token" if offered else "no auth token")


def refusal(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler that ends any call with ``code`` before reading its body.

    Streaming on both sides whatever the method's shape: gRPC reads no request message
    for a streaming handler until it asks for one, and a client of any shape sees only
    the status, since no message is sent.
    """

    def abort(_requests: Iterator[bytes], context: grpc.ServicerContext) -> None:
        context.abort(code, details)  # raises: the call ends here

    return grpc.stream_stream_rpc_method_handler(abort)
