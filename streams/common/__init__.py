"""Pieces every vmstream process shares: settings, logs, metrics, Kafka clients, topics, codecs, signing."""
