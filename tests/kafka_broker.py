"""Apache Kafka for the tests: KRaft brokers started from Maven Central's artifacts on 127.0.0.1.

``tests/kafka/pom.xml`` names the broker and its clients; Maven resolves them
once and the classpath is cached (``tests/maven.py``). A broker is one JVM in KRaft combined
mode (broker and controller in one process) on free ports, with a small heap,
its data under the test's directory and its log in ``kafka.log`` beside it.

- ``start_kafka(directory)``: one node; ``.bootstrap`` is its PLAINTEXT
  address. Options add a SASL/SCRAM-SHA-512 listener (``scram=``, the user is
  added at format time) and a TLS listener (``tls=``, the certificate the
  tests made with ``make_tls_files``).
- ``start_kafka_cluster(directory)``: three nodes, a controller quorum of
  three, replication factor 3 and ``min.insync.replicas=2``.

A node's ``stop`` is a clean shutdown, ``kill`` is kill -9, ``start`` brings it
back on the same ports with the data it had, ``freeze``/``thaw`` are
SIGSTOP/SIGCONT. A JVM takes seconds to start, so tests share one: the
``kafka`` fixture is one broker per test session (per xdist worker), and each
case names its topics and groups with a prefix of its own (``Namespace``).
A test that stops or freezes a broker starts its own.
"""

from __future__ import annotations

import base64
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nemesis.broker.kafka.config import KafkaBackendConfig
from tests.maven import maven_classpath

POM = Path(__file__).resolve().parent / "kafka" / "pom.xml"

# The broker logs to stdout (kafka.log): INFO, without the per-request chatter.
LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""

READY_LINE = b"Kafka Server started"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kafka_classpath() -> str:
    """The broker's classpath, resolved by Maven from ``tests/kafka/pom.xml`` once and cached."""
    return maven_classpath(POM, "kafka", "Apache Kafka")


def kafka_uuid() -> str:
    """A cluster id as Kafka writes one: 16 random bytes, URL-safe base64 without padding."""
    while True:
        text = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        if not text.startswith("-"):  # Kafka refuses ids that look like an option
            return text


@dataclass(frozen=True)
class ScramUser:
    """A SCRAM-SHA-512 user the broker knows from its first start."""

    username: str = "nemesis"
    password: str = field(default_factory=lambda: secrets.token_urlsafe(18))


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a test CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A CA of the test's own, and a server and a client certificate it signs (openssl)."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *curve, "-days", "2", "-subj", "/CN=nemesis test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    for name, extension in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        run("req", *curve, "-subj", f"/CN={name}", "-keyout", f"{name}.key.tmp",
            "-out", f"{name}.csr")  # fmt: skip
        # Kafka reads PEM keys in PKCS#8.
        run("pkcs8", "-topk8", "-nocrypt", "-in", f"{name}.key.tmp", "-out", f"{name}.key")
        (directory / "ext.cnf").write_text(extension + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf",
            "-out", f"{name}.crt")  # fmt: skip
    for key in directory.glob("*.key*"):
        key.chmod(0o600)
    return TlsFiles(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


@dataclass
class KafkaNode:
    """One Kafka JVM (broker and controller); its data directory outlives a stop or a kill."""

    node_id: int
    directory: Path
    classpath: str
    heap_mb: int
    ports: dict[str, int]
    voters: str = ""
    cluster_id: str = ""
    settings: dict[str, str] = field(default_factory=dict)
    scram: ScramUser | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.directory / "kafka.log"

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    def address(self, listener: str = "PLAINTEXT") -> str:
        return f"127.0.0.1:{self.ports[listener]}"

    @property
    def bootstrap(self) -> str:
        return self.address()

    def properties(self) -> str:
        listeners = ",".join(f"{name}://127.0.0.1:{port}" for name, port in self.ports.items())
        advertised = ",".join(
            f"{name}://127.0.0.1:{port}"
            for name, port in self.ports.items()
            if name != "CONTROLLER"
        )
        protocols = ",".join(
            f"{name}:{'PLAINTEXT' if name == 'CONTROLLER' else name}" for name in self.ports
        )
        lines = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters,
            "listeners": listeners,
            "advertised.listeners": advertised,
            "listener.security.protocol.map": protocols,
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir),
            # Small and quick: few threads, small internal topics, no rebalance delay.
            "num.network.threads": "2",
            "num.io.threads": "2",
            "background.threads": "2",
            "num.recovery.threads.per.data.dir": "1",
            "num.replica.fetchers": "1",
            "log.cleaner.threads": "1",
            "log.cleaner.dedupe.buffer.size": str(4 * 1024 * 1024),
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.num.partitions": "4",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
        }
        lines.update(self.settings)
        return "".join(f"{key}={value}\n" for key, value in lines.items())

    def java(self, main: str, *args: str, heap_mb: int) -> list[str]:
        return [
            "java",
            f"-Xmx{heap_mb}m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-XX:+ExitOnOutOfMemoryError",
            "-XX:-UsePerfData",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.directory / 'log4j2.properties'}",
            "-cp",
            self.classpath,
            main,
            *args,
        ]

    def format_command(self) -> list[str] | None:
        """The StorageTool command that formats the data directory; None once it is formatted."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "log4j2.properties").write_text(LOG4J2)
        (self.directory / "server.properties").write_text(self.properties())
        if (self.data_dir / "meta.properties").is_file():
            return None
        command = ["format", "-t", self.cluster_id, "-c", str(self.directory / "server.properties")]
        if self.scram is not None:
            user = self.scram
            command += [
                "--add-scram",
                f"SCRAM-SHA-512=[name={user.username},password={user.password}]",
            ]
        return self.java("kafka.tools.StorageTool", *command, heap_mb=128)

    def launch(self) -> None:
        """Starts the JVM without waiting for it (``wait_ready`` does)."""
        assert self.process is None or self.process.poll() is not None, "already running"
        command = self.format_command()
        if command is not None:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"kafka storage format failed: {done.stdout}{done.stderr}")
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.java(
                "kafka.Kafka", str(self.directory / "server.properties"), heap_mb=self.heap_mb
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()

    def wait_ready(self, timeout_s: float = 90) -> None:
        """Waits for the broker to report it started (it has joined the quorum, unfenced)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while True:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                if READY_LINE in log.read():
                    return
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
                raise RuntimeError(
                    f"kafka node {self.node_id} did not start (see {self.log_path}):\n"
                    + "\n".join(tail)
                )
            time.sleep(0.1)

    def start(self, timeout_s: float = 90) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self) -> None:
        """Asks the JVM to shut down cleanly (SIGTERM), without waiting."""
        if self.running:
            assert self.process is not None
            self.process.send_signal(signal.SIGCONT)  # a frozen broker cannot stop
            self.process.terminate()

    def wait_stopped(self, timeout_s: float = 60) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def stop(self, timeout_s: float = 60) -> None:
        """A clean shutdown (the broker hands over its leaderships first)."""
        self.terminate()
        self.wait_stopped(timeout_s)

    def kill(self) -> None:
        """kill -9: no shutdown at all; what was flushed to the log files stays."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: the broker holds its connections and its data but answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


# One broker is one node: the same object, under the name the tests use for it.
KafkaBroker = KafkaNode


def listener_ports(scram: ScramUser | None, tls: TlsFiles | None) -> dict[str, int]:
    ports = {"PLAINTEXT": free_port(), "CONTROLLER": free_port()}
    if scram is not None:
        ports["SASL_PLAINTEXT"] = free_port()
    if tls is not None:
        ports["SSL"] = free_port()
    return ports


def security_settings(scram: ScramUser | None, tls: TlsFiles | None) -> dict[str, str]:
    settings: dict[str, str] = {}
    if scram is not None:
        settings["sasl.enabled.mechanisms"] = "SCRAM-SHA-512"
        settings["listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config"] = (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        )
    if tls is not None:
        prefix = "listener.name.ssl."
        settings[prefix + "ssl.keystore.type"] = "PEM"
        settings[prefix + "ssl.keystore.certificate.chain"] = pem_value(tls.server_cert)
        settings[prefix + "ssl.keystore.key"] = pem_value(tls.server_key)
        settings[prefix + "ssl.truststore.type"] = "PEM"
        settings[prefix + "ssl.truststore.certificates"] = pem_value(tls.ca)
        settings[prefix + "ssl.client.auth"] = "required"
    return settings


def pem_value(path: Path) -> str:
    """A PEM file as one properties value (line breaks escaped)."""
    return path.read_text().strip().replace("\n", "\\n\\\n")


def start_kafka(
    directory: Path,
    *,
    scram: ScramUser | None = None,
    tls: TlsFiles | None = None,
    heap_mb: int = 384,
) -> KafkaBroker:
    """One Apache Kafka node in ``directory``, started and ready."""
    classpath = kafka_classpath()
    ports = listener_ports(scram, tls)
    broker = KafkaNode(
        node_id=1,
        directory=directory / "kafka",
        classpath=classpath,
        heap_mb=heap_mb,
        ports=ports,
        voters=f"1@127.0.0.1:{ports['CONTROLLER']}",
        cluster_id=kafka_uuid(),
        settings=security_settings(scram, tls),
        scram=scram,
    )
    broker.start()
    return broker


@dataclass
class KafkaCluster:
    """Three nodes, each a broker and a controller; replication factor 3, two in sync."""

    nodes: list[KafkaNode]

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def bootstrap_servers(self) -> list[str]:
        return [node.bootstrap for node in self.nodes]

    def node(self, node_id: int) -> KafkaNode:
        return next(node for node in self.nodes if node.node_id == node_id)

    def start(self, timeout_s: float = 120) -> None:
        """Starts every node that is not running; the quorum needs two, so all start at once."""
        stopped = [node for node in self.nodes if not node.running]
        commands = [(node, node.format_command()) for node in stopped]
        formats = [
            (node, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            for node, command in commands
            if command is not None
        ]
        for node, process in formats:
            output, _ = process.communicate(timeout=120)
            if process.returncode != 0:
                raise RuntimeError(
                    f"kafka storage format failed on node {node.node_id}: {output!r}"
                )
        for node in stopped:
            node.launch()
        for node in stopped:
            node.wait_ready(timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            node.terminate()
        for node in self.nodes:
            node.wait_stopped(30)


def start_kafka_cluster(directory: Path, *, size: int = 3, heap_mb: int = 256) -> KafkaCluster:
    """``size`` Apache Kafka nodes in ``directory``/kafka-N, started and ready."""
    classpath = kafka_classpath()
    ports = [listener_ports(None, None) for _ in range(size)]
    voters = ",".join(f"{n + 1}@127.0.0.1:{p['CONTROLLER']}" for n, p in enumerate(ports))
    cluster_id = kafka_uuid()
    replicated = {
        "default.replication.factor": str(size),
        "min.insync.replicas": str(min(2, size)),
        "offsets.topic.replication.factor": str(size),
        "transaction.state.log.replication.factor": str(size),
        "transaction.state.log.min.isr": str(min(2, size)),
        "share.coordinator.state.topic.replication.factor": str(size),
        "share.coordinator.state.topic.min.isr": str(min(2, size)),
    }
    cluster = KafkaCluster(
        [
            KafkaNode(
                node_id=n + 1,
                directory=directory / f"kafka-{n + 1}",
                classpath=classpath,
                heap_mb=heap_mb,
                ports=ports[n],
                voters=voters,
                cluster_id=cluster_id,
                settings=dict(replicated),
            )
            for n in range(size)
        ]
    )
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """One Apache Kafka broker for the session (per xdist worker); never stopped by a case."""
    broker = start_kafka(tmp_path_factory.mktemp("kafka"))
    try:
        yield broker
    finally:
        broker.stop()


@dataclass(frozen=True)
class Namespace:
    """A test's own prefix for topic and group names on the shared broker."""

    prefix: str = field(default_factory=lambda: f"t{secrets.token_hex(4)}-")

    def __call__(self, name: str) -> str:
        return f"{self.prefix}{name}"


def kafka_backend_config(bootstrap: str | list[str], **overrides: Any) -> KafkaBackendConfig:
    """The backend block for a test broker: the defaults, with quicker failure detection."""
    servers = bootstrap.split(",") if isinstance(bootstrap, str) else list(bootstrap)
    settings: dict[str, Any] = {
        "bootstrap_servers": servers,
        "default_partitions": 2,
        # A member that dies is noticed in seconds, not the default ten.
        "session_timeout_s": 6,
        "heartbeat_interval_s": 1,
        "connect_timeout_s": 10,
        "request_timeout_s": 10,
        "linger_ms": 1,
    }
    settings.update(overrides)
    return KafkaBackendConfig.model_validate(settings)
