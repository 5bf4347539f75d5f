"""The ``vmstream`` command and the user tools it offers (simulate, schemas, intent, tail, replay)."""
