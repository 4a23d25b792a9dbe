"""Who may call a state server: a shared bearer token in call metadata, checked by a
server interceptor, and optional mutual TLS. Health checks (``Check``, the one health
method served: services/transport/health.py) stay open so orchestrators can probe
liveness without the secret; they reveal nothing and change nothing.

A call without the token is refused before gRPC reads any of its body (see
:func:`~cargohold.services.transport.limits.refusal`), on the server's quick pool.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from cargohold.cluster.schema.run import TLS_FILES, SecurityConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.transport.health import CHECK_METHOD
from cargohold.services.transport.limits import refusal

AUTH_METADATA_KEY = "authorization"
OPEN_METHODS = frozenset({CHECK_METHOD})


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

    def server_context(self) -> ssl.SSLContext:
        """The bulk socket's side of mutual TLS: as :meth:`server_credentials`."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._load(context)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        """A bulk connection's side of mutual TLS: the server's certificate must be the
        CA's and name the host dialled, as gRPC checks it."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        self._load(context)
        return context

    def _load(self, context: ssl.SSLContext) -> None:
        self.read()  # a missing file is a ConfigError naming it, as for gRPC
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
            context.load_verify_locations(cafile=self.ca_file)
        except ssl.SSLError as error:
            raise ConfigError(f"TLS files {self.cert_file}, {self.key_file}, {self.ca_file}: {error}") from error


def tls_files(security: SecurityConfig) -> TlsFiles | None:
    """The mutual-TLS files of ``security.tls_dir``; None when TLS is off."""
    if security.tls_dir is None:
        return None
    cert, key, ca = (str(Path(security.tls_dir).expanduser() / name) for name in TLS_FILES)
    return TlsFiles(cert_file=cert, key_file=key, ca_file=ca)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates with ``token``."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call but health checks unless it carries ``Bearer <token>``; the
    refusals run on ``quick`` (the server's pool when None)."""

    def __init__(self, token: str, quick: ThreadPoolExecutor | None = None) -> None:
        if not token:
            raise ConfigError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._quick = quick

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        if handler_call_details.method in OPEN_METHODS:
            return continuation(handler_call_details)
        offered = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(offered.encode(), self._expected):
            return continuation(handler_call_details)
        # Not continuation(): a refused call goes no further, not even to find its handler.
        reason = "missing or wrong auth token" if offered else "no auth token"
        return refusal(grpc.StatusCode.UNAUTHENTICATED, reason, self._quick)
