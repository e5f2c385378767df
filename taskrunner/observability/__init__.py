"""What taskrunner tells operators: its logging (``logs``), the round-trip counter the
benchmarks use (``roundtrips``) and the redaction of secrets in what it logs or stores
(``redact``). Prometheus metrics are the public ``taskrunner.metrics``."""
