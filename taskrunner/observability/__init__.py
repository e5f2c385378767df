"""What taskrunner tells operators: Prometheus metrics (``metrics``, public: the worker's
observer and its HTTP endpoint), its logging (``logs``), the round-trip counter the
benchmarks use (``roundtrips``) and the redaction of secrets in what it logs or stores
(``redact``)."""
