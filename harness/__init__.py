"""The development harness: a local Kafka broker, a local control plane, the demo and its scenarios.

Run from a checkout (``python -m harness``); the product never imports it and it is not
shipped in the wheel or the image."""
