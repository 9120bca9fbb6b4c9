"""The ``kafka`` broker kind: any Kafka-protocol broker (``nemesis.broker.kafka``).

Its configuration (brokers, security, client tuning) is validated like every
other block (frozen, unknown keys refused); secrets come from ``${VAR}``
references, never the file itself. aiokafka is imported only when the
factory runs: a process on another broker never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, SecretStr, model_validator

from nemesis.backends.base import BackendModel, BrokerKind, ProcessConfig
from nemesis.config_base import DurationS, Model

if TYPE_CHECKING:
    from nemesis.broker.port import Broker
    from nemesis.clock import Clock

# host:port, a bracketed IPv6 address allowed: what every Kafka client takes.
_SERVER = r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}$"


class KafkaSaslConfig(Model):
    """SASL sign-in: PLAIN or SCRAM; set the password from the environment."""

    mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    username: Annotated[str, Field(min_length=1)]
    password: SecretStr  # ``password: ${KAFKA_PASSWORD}``


class KafkaTlsConfig(Model):
    """TLS to the brokers: the CA that signed them, and a client certificate if they ask for one."""

    # PEM file with the CA certificates; None: the system's trust store.
    ca_file: str | None = None
    # Client certificate and key (PEM) for brokers that authenticate clients by certificate.
    cert_file: str | None = None
    key_file: str | None = None
    key_password: SecretStr | None = None
    # Off only for a test broker with a self-signed certificate and no name to check.
    check_hostname: bool = True

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> KafkaTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: a client certificate and its key")
        return self


class KafkaBackendConfig(BackendModel):
    """Any Kafka-protocol broker: Apache Kafka, Redpanda, YDB's Kafka endpoint (docs/kafka.md)."""

    kind: Literal["kafka"] = "kafka"
    bootstrap_servers: Annotated[
        list[Annotated[str, Field(pattern=_SERVER)]], Field(min_length=1, max_length=64)
    ]
    client_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,100}$")] = "nemesis"
    sasl: KafkaSaslConfig | None = None
    tls: KafkaTlsConfig | None = None
    # Topics Nemesis creates (retry tiers, replays, `nemesis topics create`).
    default_partitions: Annotated[int, Field(ge=1, le=10_000)] = 4
    replication_factor: Annotated[int, Field(ge=1, le=32)] = 1
    retention: DurationS = 7 * 86400.0
    # Exactly-once writes per producer session (Kafka's idempotent producer): a write
    # retried by the client after a lost answer is not written twice. Off only for
    # brokers without InitProducerId (docs/kafka.md).
    idempotent_producer: bool = True
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "none"
    linger_ms: Annotated[int, Field(ge=0, le=10_000)] = 5
    # Consumer group membership: a member silent for session_timeout_s loses its partitions.
    session_timeout_s: Annotated[float, Field(ge=1, le=3600)] = 10.0
    heartbeat_interval_s: Annotated[float, Field(gt=0, le=600)] = 3.0
    # A member that does not ask for messages for this long leaves the group (a stuck loop).
    max_poll_interval_s: Annotated[float, Field(ge=1, le=86_400)] = 300.0
    # Off for YDB's Kafka endpoint, which does not keep Kafka's record CRCs.
    check_crcs: bool = True
    fetch_max_bytes: Annotated[int, Field(ge=1024)] = 50 * 1024 * 1024
    max_partition_fetch_bytes: Annotated[int, Field(ge=1024)] = 1024 * 1024
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    # Bounds every admin call, commit and write acknowledgement.
    request_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    # How far back a writer of a stable producer id looks, on its first write with
    # seqnos to a partition, for the last seqno it wrote there (see docs/kafka.md).
    dedup_lookback_messages: Annotated[int, Field(ge=0, le=1_000_000)] = 10_000

    @model_validator(mode="after")
    def _timeouts_fit_together(self) -> KafkaBackendConfig:
        if self.heartbeat_interval_s * 3 > self.session_timeout_s:
            raise ValueError(
                "heartbeat_interval_s must be at most a third of session_timeout_s"
                f" ({self.heartbeat_interval_s} > {self.session_timeout_s}/3)"
            )
        # A JoinGroup is answered when every member has rejoined, up to the rebalance
        # timeout (session_timeout_s here): a shorter request timeout abandons it.
        if self.request_timeout_s <= self.session_timeout_s:
            raise ValueError(
                "request_timeout_s must be above session_timeout_s (a group join waits up to"
                f" the session timeout): {self.request_timeout_s} <= {self.session_timeout_s}"
            )
        return self


async def open_kafka_backend(config: ProcessConfig, clock: Clock) -> Broker:
    from nemesis.broker.kafka.broker import open_kafka

    assert isinstance(config.backend, KafkaBackendConfig)  # chosen by kind
    return await open_kafka(config.backend, clock=clock)


KAFKA = BrokerKind("kafka", KafkaBackendConfig, open_kafka_backend)
