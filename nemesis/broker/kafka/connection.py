"""The client settings every aiokafka client of one backend shares: servers, TLS, SASL."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from aiokafka.conn import create_conn
from aiokafka.errors import KafkaError
from aiokafka.helpers import create_ssl_context

from nemesis.broker.kafka.config import KafkaBackendConfig


def ssl_context(config: KafkaBackendConfig) -> ssl.SSLContext | None:
    """The TLS context ``config.tls`` describes; None without TLS."""
    tls = config.tls
    if tls is None:
        return None
    context: ssl.SSLContext = create_ssl_context(
        cafile=tls.ca_file,
        certfile=tls.cert_file,
        keyfile=tls.key_file,
        password=tls.key_password.get_secret_value() if tls.key_password else None,
    )
    context.check_hostname = tls.check_hostname
    return context


def security_protocol(config: KafkaBackendConfig) -> str:
    """Kafka's name for the combination of TLS and SASL in ``config``."""
    if config.sasl is None:
        return "PLAINTEXT" if config.tls is None else "SSL"
    return "SASL_PLAINTEXT" if config.tls is None else "SASL_SSL"


def client_settings(config: KafkaBackendConfig) -> dict[str, Any]:
    """Keyword arguments for any aiokafka client (producer, consumer, admin)."""
    settings: dict[str, Any] = {
        "bootstrap_servers": list(config.bootstrap_servers),
        "client_id": config.client_id,
        "security_protocol": security_protocol(config),
        "request_timeout_ms": int(config.request_timeout_s * 1000),
        "retry_backoff_ms": 200,
        "metadata_max_age_ms": 60_000,
    }
    context = ssl_context(config)
    if context is not None:
        settings["ssl_context"] = context
    if config.sasl is not None:
        settings["sasl_mechanism"] = config.sasl.mechanism
        settings["sasl_plain_username"] = config.sasl.username
        settings["sasl_plain_password"] = config.sasl.password.get_secret_value()
    return settings


async def connection_failure(config: KafkaBackendConfig) -> BaseException | None:
    """Why one connection to the first bootstrap server fails; None when it does not.

    aiokafka's bootstrap only says that no server answered; its log holds the
    reason (a certificate the CA did not sign, refused credentials). Asked
    after a failed bootstrap, so that the error names the reason.
    """
    host, _, port = config.bootstrap_servers[0].rpartition(":")
    settings = client_settings(config)
    try:
        async with asyncio.timeout(config.connect_timeout_s):
            conn = await create_conn(
                host.strip("[]"),
                int(port),
                client_id=config.client_id,
                request_timeout_ms=settings["request_timeout_ms"],
                ssl_context=settings.get("ssl_context"),
                security_protocol=settings["security_protocol"],
                sasl_mechanism=settings.get("sasl_mechanism"),
                sasl_plain_username=settings.get("sasl_plain_username"),
                sasl_plain_password=settings.get("sasl_plain_password"),
            )
    except (KafkaError, OSError, TimeoutError) as exc:
        return exc
    conn.close()
    return None


def close_leftover_connections(client: Any) -> int:
    """Closes connections an aiokafka client opened while it was being stopped.

    aiokafka's close cancels its metadata task and closes the connections it
    knows; a connection another of its tasks was opening meanwhile lands in
    its table afterwards and is never closed (its socket leaks). Called after
    a stop; returns how many there were.
    """
    inner = getattr(client, "_client", None) or getattr(client, "client", None)
    connections = getattr(inner, "_conns", None)
    if not connections:
        return 0
    left = list(connections.values())
    for connection in left:
        connection.close()
    connections.clear()
    return len(left)
