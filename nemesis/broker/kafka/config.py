"""The ``kafka`` backend's configuration models; they live with its kind in ``nemesis.backends``."""

from nemesis.backends.kafka import KafkaBackendConfig, KafkaSaslConfig, KafkaTlsConfig

__all__ = ["KafkaBackendConfig", "KafkaSaslConfig", "KafkaTlsConfig"]
