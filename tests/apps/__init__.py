"""Importable apps for the worker process tests (``apps.acceptance_app:runner``)."""
