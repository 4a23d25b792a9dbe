"""Strangers are kept out: calls without the shared token, or with a wrong one, get
UNAUTHENTICATED and change nothing; with mutual TLS a client without a certificate the
CA signed cannot even connect. Health checks stay open for orchestrators' probes."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from bulk_peers import closed_by_peer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transport_server import DEADLINE_S, G1, GLOBAL_NORM, LR, NUMEL, RUN, W0, assert_bitwise_equal, make_spec

from cargohold.cluster.schema.io import load_config
from cargohold.services.core.errors import ConfigError, TransportError
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.server.grpc_server import GrpcStateServer
from cargohold.services.transport.auth import TlsFiles, TokenAuthInterceptor, bearer, tls_files
from cargohold.services.transport.codec import SERVICE_NAME
from cargohold.services.transport.grpc_client import RemoteError, StateServerClient
from cargohold.services.transport.limits import CallLimits

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
TOKEN = "s3cret-token"


@contextmanager
def server(**kwargs):
    metrics = StateServerMetrics("auth")
    grpc_server = GrpcStateServer(SegmentRegistry(), metrics, run_id=RUN, host="127.0.0.1", **kwargs)
    grpc_server.start()
    try:
        yield grpc_server
    finally:
        grpc_server.stop(0.2)


def test_calls_without_or_with_a_wrong_token_are_refused_and_change_nothing() -> None:
    with (
        server(auth_token=TOKEN) as s,
        StateServerClient(s.address, timeout_s=10, auth_token=TOKEN) as good,
        StateServerClient(s.address, timeout_s=10) as anonymous,
        StateServerClient(s.address, timeout_s=10, auth_token="guess") as wrong,
    ):
        good.wait_ready(10)
        anonymous.wait_ready(10)  # health checks need no token
        for client, reason in ((anonymous, "no auth token"), (wrong, "wrong auth token")):
            for call in (
                lambda c: c.register(make_spec(), W0),
                lambda c: c.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR),
                lambda c: c.fetch(RUN, 0, 0, "float32", NUMEL),
                lambda c: c.describe(RUN, 0),
                lambda c: c.stats(),
            ):
                with pytest.raises(RemoteError) as error:
                    call(client)
                assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert reason in error.value.details
                assert TOKEN not in str(error.value)
        assert good.stats().segment_updates == {}  # the refused register created nothing
        good.register(make_spec(), W0)
        with pytest.raises(RemoteError):
            wrong.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR)
        assert good.describe(RUN, 0)[1] == 0
        assert good.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied


METHODS = ("RegisterShard", "DescribeShard", "PushGradient", "CommitStep", "FetchWeights", "GetStats", "OpenBulk")


def _held_back(release: threading.Event, sent: list[bytes]) -> Iterator[bytes]:
    """A request stream that sends nothing until ``release`` is set."""
    release.wait(DEADLINE_S)
    sent.append(b"")
    yield b""


def test_a_call_without_the_token_is_refused_before_its_body_is_read() -> None:
    """The refusal comes while the caller has sent nothing but its headers. (gRPC used
    to receive and parse a whole unary request, up to 32 MiB, before the refusal ran.)"""
    with server(auth_token=TOKEN) as s, grpc.insecure_channel(s.address) as channel:
        for method in METHODS:
            release, sent = threading.Event(), []
            call = channel.stream_stream(f"/{SERVICE_NAME}/{method}")(_held_back(release, sent), timeout=DEADLINE_S / 2)
            try:
                with pytest.raises(grpc.RpcError) as refused:
                    next(call)
                assert (refused.value.code(), refused.value.details()) == (
                    grpc.StatusCode.UNAUTHENTICATED,
                    "no auth token",
                )
                assert not sent, method
            finally:
                release.set()


def test_health_is_open_without_a_token() -> None:
    with server(auth_token=TOKEN) as s, grpc.insecure_channel(s.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


WATCH_FLOOD = 300
"""Anonymous Watch streams opened at once, as the red team's client did (twice)."""


def test_anonymous_watch_streams_cannot_freeze_the_server() -> None:
    """Before: the stock health servicer served Watch to callers without the token, each
    stream holding one of the probes' two threads and, while sending, the lock Check
    needs; two floods of a few hundred cancelled streams left every later call, the
    token holder's and Check itself, at DEADLINE_EXCEEDED. Now Watch is not served."""
    with (
        server(auth_token=TOKEN) as s,
        grpc.insecure_channel(s.address) as channel,
        StateServerClient(s.address, timeout_s=10, auth_token=TOKEN) as good,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(2):
            streams = [
                health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=DEADLINE_S)
                for _ in range(WATCH_FLOOD)
            ]
            for stream in streams:
                stream.cancel()
        with pytest.raises(grpc.RpcError) as refused:
            next(health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        good.register(make_spec(), W0)
        assert good.describe(RUN, 0)[1] == 0
        authorised = health.Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5, metadata=bearer(TOKEN)
        )
        with pytest.raises(grpc.RpcError) as unserved:  # with the token too: Check only
            next(authorised)
        assert unserved.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_an_empty_token_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="must not be empty"):
        TokenAuthInterceptor("")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TlsFiles]:
    """A CA, a certificate it signed for 127.0.0.1, and one from a stranger CA, each in a
    folder of ``security.tls_dir``."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={ca}",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
            cwd=d,
        )
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            f"{ca}-node.key",
            "-out",
            f"{ca}-node.csr",
            cwd=d,
        )
        (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{ca}-node.csr",
            "-CA",
            f"{ca}.pem",
            "-CAkey",
            f"{ca}.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            f"{ca}-node.pem",
            cwd=d,
        )
    files = {}
    for ca in ("ca", "rogue"):  # each as security.tls_dir reads it: a TLS secret's three files
        secret = d / f"{ca}-secret"
        secret.mkdir()
        shutil.copy(d / f"{ca}-node.pem", secret / "tls.crt")
        shutil.copy(d / f"{ca}-node.key", secret / "tls.key")
        shutil.copy(d / "ca.pem", secret / "ca.crt")  # the rogue trusts the run's CA, which did not sign it
        tls = tls_files(load_config(None, [f"security.tls_dir={secret}"]).security)
        assert tls is not None
        files[ca] = tls
    return files


def test_mutual_tls_admits_only_certificates_of_the_ca(pki) -> None:
    with server(auth_token=TOKEN, tls=pki["ca"]) as s:
        with StateServerClient(s.address, timeout_s=10, auth_token=TOKEN, tls=pki["ca"]) as good:
            good.register(make_spec(), W0)
            assert good.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
            weights = good.fetch(RUN, 0, 1, "float32", NUMEL)
        with StateServerClient(s.address, timeout_s=3, auth_token=TOKEN, tls=pki["rogue"]) as rogue:
            with pytest.raises((RemoteError, TransportError)):
                rogue.push(RUN, 0, 2, G1, global_norm=GLOBAL_NORM, lr=LR)
        with StateServerClient(s.address, timeout_s=3, auth_token=TOKEN) as plaintext:
            with pytest.raises(RemoteError) as error:
                plaintext.describe(RUN, 0)
            assert error.value.code == grpc.StatusCode.UNAVAILABLE
        with StateServerClient(s.address, timeout_s=10, auth_token=TOKEN, tls=pki["ca"]) as good:
            assert good.describe(RUN, 0)[1] == 1
            assert_bitwise_equal(good.fetch(RUN, 0, 1, "float32", NUMEL), weights)


def test_the_bulk_socket_speaks_mutual_tls_with_the_same_certificates(pki) -> None:
    with server(auth_token=TOKEN, tls=pki["ca"], bulk=True) as s:
        with StateServerClient(s.address, timeout_s=10, auth_token=TOKEN, tls=pki["ca"], bulk=True) as good:
            good.register(make_spec(), W0)
            assert good.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
            over_bulk = good.fetch(RUN, 0, 1, "float32", NUMEL)
            grant = good._call("OpenBulk", good._stub.OpenBulk, _fetch_bulk(1))
        with StateServerClient(s.address, timeout_s=10, auth_token=TOKEN, tls=pki["ca"]) as over_grpc:
            assert_bitwise_equal(over_bulk, over_grpc.fetch(RUN, 0, 1, "float32", NUMEL))
        host = s.address.rpartition(":")[0]
        with socket.create_connection((host, grant.port), timeout=10) as plaintext:
            plaintext.sendall(bytes(56))  # a hello, not a TLS handshake: dropped unread
            assert closed_by_peer(plaintext)
        rogue = pki["rogue"].client_context()
        with pytest.raises(ssl.SSLError):
            with socket.create_connection((host, grant.port), timeout=10) as raw:
                with rogue.wrap_socket(raw, server_hostname=host) as wrapped:
                    wrapped.sendall(bytes(56))
                    wrapped.recv(64)
        with StateServerClient(s.address, timeout_s=10, auth_token=TOKEN, tls=pki["ca"]) as good:
            assert good.describe(RUN, 0)[1] == 1


def test_a_bulk_tls_handshake_that_never_completes_is_closed_at_the_hello_deadline(pki) -> None:
    """The hello deadline covers the TLS handshake: a stranger who connects and sends no
    ClientHello (or trickles one) is closed after ``hello_timeout_s``, not after the 60 s
    stall timeout of each read."""
    hello_timeout_s = 1.0
    limits = CallLimits(hello_timeout_s=hello_timeout_s)
    with server(auth_token=TOKEN, tls=pki["ca"], bulk=True, limits=limits) as s:
        port = s.servicer.bulk.port
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as stranger:
            assert closed_by_peer(stranger)
        assert hello_timeout_s <= time.monotonic() - started < hello_timeout_s + 2.0
        with StateServerClient(s.address, timeout_s=10, auth_token=TOKEN, tls=pki["ca"], bulk=True) as good:
            good.register(make_spec(), W0)
            assert good.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied


def _fetch_bulk(step: int):
    from cargohold.v1 import state_server_pb2 as pb

    fetch = pb.FetchWeightsRequest(key=pb.ShardKey(run_id=RUN, shard_id=0), step=step, dtype=pb.DTYPE_FLOAT32)
    return pb.OpenBulkRequest(fetch=fetch)


def test_missing_tls_files_are_a_config_error(tmp_path: Path) -> None:
    files = TlsFiles(cert_file=str(tmp_path / "nope.pem"), key_file="k", ca_file="c")
    with pytest.raises(ConfigError, match="nope.pem"):
        files.server_credentials()


def test_tls_dir_names_a_secrets_three_files(tmp_path: Path) -> None:
    (tmp_path / "tls.crt").write_text("cert")
    (tmp_path / "tls.key").write_text("key")
    (tmp_path / "ca.crt").write_text("ca")
    files = tls_files(load_config(None, [f"security.tls_dir={tmp_path}"]).security)
    assert files == TlsFiles(
        cert_file=str(tmp_path / "tls.crt"), key_file=str(tmp_path / "tls.key"), ca_file=str(tmp_path / "ca.crt")
    )
    assert tls_files(load_config().security) is None  # no TLS by default


def test_a_tls_dir_without_its_files_is_refused_naming_them_when_the_config_loads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"security\.tls_dir '.*/absent' is not a folder"):
        load_config(None, [f"security.tls_dir={tmp_path / 'absent'}"])
    (tmp_path / "tls.crt").write_text("cert")
    with pytest.raises(ConfigError, match=r"security\.tls_dir '.*' holds no tls\.key, ca\.crt"):
        load_config(None, [f"security.tls_dir={tmp_path}"])


@pytest.mark.parametrize("old", ["tls_cert_file", "tls_key_file", "tls_ca_file"])
def test_the_three_file_keys_are_refused_naming_tls_dir(old: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown config key 'security\.{old}': set security\.tls_dir, a folder"):
        load_config(None, [f"security.{old}=/x.pem"])


def test_the_launcher_token_comes_from_the_environment_or_is_fresh(monkeypatch) -> None:
    from cargohold.cluster.connect import resolve_auth_token

    monkeypatch.setenv("CARGOHOLD_TEST_TOKEN", "from-env")
    assert resolve_auth_token("CARGOHOLD_TEST_TOKEN") == "from-env"
    monkeypatch.delenv("CARGOHOLD_TEST_TOKEN")
    fresh = {resolve_auth_token("CARGOHOLD_TEST_TOKEN") for _ in range(3)}
    assert len(fresh) == 3 and all(len(t) >= 32 for t in fresh)
    assert resolve_auth_token(None) is None


def test_the_launcher_always_reads_cargohold_auth_token(monkeypatch) -> None:
    """No key names the token's variable: the launcher reads CARGOHOLD_AUTH_TOKEN, and the
    retired key is refused saying so."""
    from cargohold.cluster.connect import resolve_auth_token

    monkeypatch.setenv("CARGOHOLD_AUTH_TOKEN", "from-env")
    assert resolve_auth_token(load_config(None).security.auth_token_env) == "from-env"
    refused = r"unknown config key 'security\.auth_token_env': no key sets it: .* variable CARGOHOLD_AUTH_TOKEN"
    for value in ("MY_TOKEN", "null"):
        with pytest.raises(ConfigError, match=refused):
            load_config(None, [f"security.auth_token_env={value}"])
