"""The rules: pure functions of typed inputs; no Kafka, no HTTP, no clock inside.

One sub-package per role, each importing only those below it (the import contracts in
pyproject.toml; tests/test_layers.py fails on an import circle):

    decide | reads   the engine, every input in through Engine.decide | what people are shown
    rules            the rules, one concern a module
    core             what the rules work on: the observed cluster, the tables, the state, the decision
    contracts        each fact declared once: messages, topics, CloudEvents, configuration, ids
"""
