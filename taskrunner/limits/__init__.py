"""Fleet-wide limits: the stored state of each name (``state``), the gate arithmetic of
rates and running slots (``gates``), the worker side that leases them (``gatekeeper``)
and follows the limits documents (``watch``)."""
