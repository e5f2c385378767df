"""The database seam: the ``Store`` protocol (``base``), MongoDB (``mongo``) and its
in-memory twin (``memory``), the task rules written twice, in Python (``rules``) and as
MongoDB expressions (``expressions``), field and index names (``fields``), the document
budget (``sizes``), the validator and the start-up check (``preflight``).

Nothing is imported here: the CLI reads ``fields`` for its help without loading the store.
What users name (``MemoryStore``, ``ServerCheck``, ``ServerInfo``) is exported by
``taskrunner``; the rest is internal and may change.
"""
