"""Contract suites run against every adapter."""
