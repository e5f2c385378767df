"""The dashboard driven by a real browser: Debian's chromium through Playwright (issue 13's proof)."""
