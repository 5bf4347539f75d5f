"""Processes that serve people outside Kafka: owners' notifications and the consoles' read API."""
