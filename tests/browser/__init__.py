"""The dashboard driven by a real browser: Debian's chromium through Playwright."""
