"""Sample inputs shared by the harness and the tests: one small AZ, described once.

Run from a checkout; not shipped in the wheel or the image."""
