"""Unit tests: no server and no process of their own; each runs in milliseconds (also on Python 3.11)."""
