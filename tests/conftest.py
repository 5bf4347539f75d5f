"""Plugins for the real parts: a Kafka broker and a kube-apiserver, started once a session."""

pytest_plugins = ["tests.kafka_broker", "tests.kube_apiserver"]
