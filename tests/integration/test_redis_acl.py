"""Redis with ACL users and TLS: the worker's user and password (from a file) work, rediss:// with
its CA too; a wrong password fails in one clear line that never shows it."""

from __future__ import annotations

import ipaddress
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from deploy.harness import Proc, free_port, wait_for
from milpa_sessions.cli import main
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from session_model.projection import BatchFolder, Position, Record
from tests.integration.conftest import with_keys
from tests.unit.builders import started, turn

pytestmark = pytest.mark.integration

PASSWORD = "w0rker-s3cret-Zq"


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A redis-server of this test's own: no default user, a `worker` user with a password."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    args = [
        binary,
        *("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
        *("--user", "default", "off"),
        *("--user", "worker", "on", f">{PASSWORD}", "~*", "&*", "+@all"),
    ]
    proc = Proc.start("redis-acl", args, tmp_path / "redis.log", cwd=tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    probe = redis.Redis.from_url(url, username="worker", password=PASSWORD, socket_timeout=1)
    wait_for(lambda: _pings(probe), timeout=20)
    probe.close()
    secret = tmp_path / "redis-worker.password"
    secret.write_text(PASSWORD + "\n")
    secret.chmod(0o600)
    yield {"url": url, "password_file": secret, "tmp": tmp_path}
    proc.kill9()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_the_worker_projects_into_an_acl_redis_with_its_user_and_password_file(
    settings: Settings, kafka_log: KafkaEventLog, acl_redis: dict[str, Any], start_worker: Any
) -> None:
    secured = with_keys(
        settings,
        redis_url=acl_redis["url"],
        redis_username="worker",
        redis_password_file=acl_redis["password_file"],
    )
    start_worker(secured)
    kafka_log.append(started("behind an ACL", session_id="acl-1"))
    kafka_log.append(turn("user", "hello", session_id="acl-1"))
    store = RedisProjectionStore.from_url(
        acl_redis["url"], secured.redis_keys(), auth=secured.redis_auth()
    )
    wait_for(lambda: (s := store.load("acl-1")) is not None and s.turn_count == 1, timeout=60)
    store.client.close()
    env = {**secured.to_env()}
    shown = CliRunner().invoke(main, ["show", "acl-1"], env=env)
    assert shown.exit_code == 0, shown.output


def test_a_wrong_redis_password_fails_in_one_line_without_the_password(
    settings: Settings, acl_redis: dict[str, Any]
) -> None:
    wrong = acl_redis["tmp"] / "wrong.password"
    wrong.write_text("not-the-password")
    runs = {
        "wrong password": {
            "MILPA_REDIS_USERNAME": "worker",
            "MILPA_REDIS_PASSWORD_FILE": str(wrong),
        },
        "no credentials": {},
        "unreadable file": {"MILPA_REDIS_PASSWORD_FILE": str(acl_redis["tmp"] / "missing")},
    }
    for what, extra in runs.items():
        env = {**settings.to_env(), "MILPA_REDIS_URL": acl_redis["url"], **extra}
        result = CliRunner().invoke(main, ["list"], env=env)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1, (what, result.output)
        assert len(lines) == 1 and lines[0].startswith("error:"), (what, result.output)
        assert "Traceback" not in result.output
        assert PASSWORD not in result.output and "not-the-password" not in result.output


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "redis.crt", directory / "redis.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return cert_file, key_file


def test_a_tls_redis_is_reached_with_rediss_and_its_ca(settings: Settings, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    port = free_port()
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    args = [
        binary,
        *("--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"),
        *("--tls-cert-file", str(cert), "--tls-key-file", str(key)),
        *("--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"),
        *("--save", "", "--appendonly", "no"),
        *("--user", "default", "off"),
        *("--user", "worker", "on", f">{PASSWORD}", "~*", "&*", "+@all"),
    ]
    proc = Proc.start("redis-tls", args, tmp_path / "redis.log", cwd=tmp_path)
    try:
        secret = tmp_path / "pw"
        secret.write_text(PASSWORD)
        tls = with_keys(
            settings,
            redis_url=f"rediss://127.0.0.1:{port}/0",
            redis_username="worker",
            redis_password_file=secret,
            redis_ca_file=cert,
        )
        store = RedisProjectionStore.from_url(
            tls.redis_url, tls.redis_keys(), auth=tls.redis_auth()
        )
        wait_for(lambda: _pings(store.client), timeout=20)
        at = Position(store.keys.partition_of("tls-1"), 0)  # where its keys live
        store.commit(BatchFolder().fold({}, [Record(started("g", session_id="tls-1"), at)]))
        assert store.load("tls-1") is not None
        store.client.close()
        listed = CliRunner().invoke(main, ["list"], env=tls.to_env())
        assert listed.exit_code == 0 and "tls-1" in listed.output, listed.output
        untrusted = CliRunner().invoke(
            main, ["list"], env={**tls.to_env(), "MILPA_REDIS_CA_FILE": ""}
        )
        assert untrusted.exit_code == 1  # the system's CAs do not know this certificate
        assert len(untrusted.output.strip().splitlines()) == 1, untrusted.output
    finally:
        proc.kill9()
