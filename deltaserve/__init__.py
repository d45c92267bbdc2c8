"""deltaserve: run and serve hybrid linear-attention language models."""

__version__ = "0.1.0"
