"""The ``kafka`` broker backend: any Kafka-protocol broker, through aiokafka.

``open_kafka`` (``nemesis.broker.kafka.broker``) is the factory the ``kafka``
kind (``nemesis.backends.kafka``) calls. How the port maps onto Kafka
(partition sessions, generation-fenced commits, pausing, writes, seqno
de-duplication), and what the tests prove: ``docs/kafka.md``.
"""
