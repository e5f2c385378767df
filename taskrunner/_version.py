"""The package version, in one leaf module (pyproject.toml reads it; nothing imported)."""

__version__ = "0.1.0"
