"""Faults injected into real processes, and the suite that counts what survives them."""
