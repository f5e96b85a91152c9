"""localrt: a local model runtime with an HTTP API and a CLI."""

__version__ = "0.1.0"
