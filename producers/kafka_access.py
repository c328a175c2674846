"""How every Kafka client of the project reaches the brokers: plaintext, or SASL (SCRAM) over TLS.

One value, built from the settings, gives the options of each client library the project runs
(kafka-python, aiokafka; Faust takes aiokafka's): a secured deployment is one set of settings, not
a change to every client. The password is read from a file and never printed.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.errors import ConfigurationError, LogError

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass(frozen=True, slots=True)
class KafkaAccess:
    """Bootstrap servers and, on a secured cluster, the credentials and the CA to trust."""

    bootstrap: str
    protocol: str = "PLAINTEXT"
    mechanism: str = "SCRAM-SHA-512"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: Path | None = None

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigurationError(
                f"Kafka security protocol {self.protocol!r}: expected one of {', '.join(PROTOCOLS)}"
            )
        if self.sasl:
            if self.mechanism not in MECHANISMS:
                raise ConfigurationError(f"SASL mechanism {self.mechanism!r} is not supported")
            if not self.username or self.password is None:
                raise ConfigurationError(f"{self.protocol} needs a Kafka username and password")

    @classmethod
    def of(cls, target: str | KafkaAccess) -> KafkaAccess:
        """`target` as access: a bare bootstrap string is a plaintext cluster."""
        return target if isinstance(target, KafkaAccess) else cls(target)

    @property
    def servers(self) -> list[str]:
        """The bootstrap servers, one per entry."""
        return self.bootstrap.split(",")

    @property
    def sasl(self) -> bool:
        """Whether clients authenticate with SASL."""
        return self.protocol.startswith("SASL")

    @property
    def tls(self) -> bool:
        """Whether connections are encrypted."""
        return self.protocol in ("SSL", "SASL_SSL")

    def _common(self) -> dict[str, Any]:
        """What both client libraries name alike: the servers, the protocol, SASL's login."""
        options: dict[str, Any] = {
            "bootstrap_servers": self.servers,
            "security_protocol": self.protocol,
        }
        if self.sasl:
            options |= {
                "sasl_mechanism": self.mechanism,
                "sasl_plain_username": self.username,
                "sasl_plain_password": self.password,
            }
        return options

    def kafka_python(self) -> dict[str, Any]:
        """Options for kafka-python's producer, consumer and admin clients."""
        options = self._common()
        if self.tls:
            options |= {"ssl_check_hostname": True}
            if self.ca_file is not None:
                options["ssl_cafile"] = str(self.ca_file)
        return options

    def aiokafka(self) -> dict[str, Any]:
        """Options for aiokafka's producer and consumer (and Faust's credentials)."""
        options = self._common()
        if self.tls:
            options["ssl_context"] = self.ssl_context()
        return options

    def check_reachable(self, timeout: float) -> None:
        """With TLS: raise `LogError` unless a bootstrap server completes a handshake in time.

        kafka-python's bootstrap timeout does not bound a TLS handshake that never ends (a hung
        broker or a wrong port held that long for over a minute): this one is bounded.
        """
        if not self.tls:
            return
        failures: list[str] = []
        context = self.ssl_context()
        for server in self.servers:
            host, _, port = server.rpartition(":")
            try:
                with (
                    socket.create_connection((host, int(port)), timeout=timeout) as raw,
                    context.wrap_socket(raw, server_hostname=host),
                ):
                    return
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                failures.append(f"{server}: {e}")
        raise LogError(f"cannot reach Kafka at {self.bootstrap}: {'; '.join(failures)}")

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context trusting `ca_file` (else the system's CAs), hostnames checked."""
        try:
            return ssl.create_default_context(
                cafile=str(self.ca_file) if self.ca_file is not None else None
            )
        except (OSError, ssl.SSLError) as e:
            raise ConfigurationError(f"Kafka CA file {self.ca_file}: {e}") from e
