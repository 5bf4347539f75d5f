"""Plugins for the real parts: a Kafka broker and a kube-apiserver, started once a session."""

pytest_plugins = ["tests.support.kafka_broker", "tests.support.kube_apiserver"]
