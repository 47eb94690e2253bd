"""Shared test fixtures.

``s3_server``: a real S3 HTTP server (moto) on 127.0.0.1, started once per session on a free
port and stopped afterwards. It can be stopped and restarted on the same port to emulate an
outage; moto keeps its buckets in-process, so data survives the restart like a real server's
disk would. While it runs, AWS_* variables from the caller's machine are hidden so that no
real profile, credential or endpoint can leak in; tests pass dummy credentials explicitly.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator

import pytest


class LoopbackS3:
    """A moto S3 server bound to 127.0.0.1 that can be stopped and restarted on its port."""

    ACCESS_KEY = "deltasync-test-access"
    SECRET_KEY = "deltasync-test-secret"  # dummy: moto accepts any credentials

    def __init__(self) -> None:
        self.port = 0
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        class _ClosingServer(ThreadedMotoServer):
            # ThreadedMotoServer.stop() stops serving but keeps the socket bound and listening,
            # so clients would hang instead of being refused and the port could not be reused.
            def stop(self) -> None:
                super().stop()
                if self._server is not None:
                    self._server.server_close()

        server = _ClosingServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        self.port = server.get_host_and_port()[1]
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self, **overrides):
        from deltasync.store import RetryPolicy, S3Config

        kwargs = dict(
            endpoint_url=self.endpoint,
            region="us-east-1",
            access_key_id=self.ACCESS_KEY,
            secret_access_key=self.SECRET_KEY,
            addressing_style="path",
            connect_timeout_s=2.0,
            read_timeout_s=10.0,
            retry=RetryPolicy(max_attempts=6, base_delay_s=0.05, max_delay_s=0.5, deadline_s=10.0),
        )
        kwargs.update(overrides)
        return S3Config(**kwargs)

    def new_bucket(self, **config_overrides) -> str:
        """Create a fresh, uniquely named bucket (moto's state is shared by the session)."""
        from deltasync.store import S3Store

        bucket = f"ds-{uuid.uuid4().hex[:20]}"
        store = S3Store(bucket, config=self.config(**config_overrides))
        store.ensure_bucket()
        store.close()
        return bucket


@pytest.fixture(scope="session")
def aws_env_isolated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hide the caller's AWS_* variables and ~/.aws files for the session, restoring them at
    the end, so boto3 sees only what the tests pass explicitly."""
    empty = tmp_path_factory.mktemp("aws-empty")
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("AWS_"):
                mp.delenv(name)
        mp.setenv("AWS_CONFIG_FILE", str(empty / "config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty / "credentials"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield


@pytest.fixture(scope="session")
def s3_server(aws_env_isolated: None) -> Iterator[LoopbackS3]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = LoopbackS3()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_session_store(s3_server: LoopbackS3):
    """One bucket and client for the session; tests take a fresh prefix with ``with_prefix``
    (creating a client and a bucket per test would cost ~1 s each)."""
    from deltasync.store import S3Store

    store = S3Store(s3_server.new_bucket(), config=s3_server.config())
    yield store
    store.close()


@pytest.fixture
def s3_store(s3_session_store):
    """An S3Store under a prefix no other test uses, on the session's loopback server."""
    return s3_session_store.with_prefix(f"t-{uuid.uuid4().hex[:12]}/run")
