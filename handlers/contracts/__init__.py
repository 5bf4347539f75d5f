"""What crosses a process boundary, each declared once: the wire messages and the topics that
carry them, their CloudEvents identity and trace context, notifications as delivered to
people, the configuration the rules obey, deterministic ids. Imports no other part of handlers.
"""
