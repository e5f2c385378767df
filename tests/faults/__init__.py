"""Fault-injection tests: bad input, security, network, crashes."""
