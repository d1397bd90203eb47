"""duplexrt: a trio runtime that serves full-duplex speech models to many real-time sessions."""

#: The one place the version is written: pyproject.toml reads it from here (setuptools parses
#: this file without importing the package), and ``duplexrt --version`` prints it.
__version__ = "0.1.0.dev0"
