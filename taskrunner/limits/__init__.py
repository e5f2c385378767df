"""Fleet-wide limits: the stored state of each name (``state``), the gate arithmetic of
rates and running slots (``gates``), the worker side that leases them (``gatekeeper``)
and follows the limits documents (``watch``). What users name (``Limit``, ``LimitState``,
``LimitView``) is exported by ``taskrunner``; the rest is internal and may change."""
