"""The ``kafka`` broker backend: any Kafka-protocol broker, through aiokafka.

``open_kafka`` (``nemesis.broker.kafka.broker``) is the factory; the client
is imported only when a kafka backend is opened. How the port maps onto
Kafka (partition sessions, generation-fenced commits, pausing, writes, seqno
de-duplication), and what the tests prove: ``docs/kafka.md``.
"""

# The configuration model is imported by nemesis.config.models, and imports from it:
# loading that module first makes either import order work.
import nemesis.config.models  # noqa: F401
