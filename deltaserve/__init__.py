"""deltaserve: run and serve hybrid linear-attention language models."""

__version__ = "0.1.0"
__all__ = ["LLM", "__version__"]


def __getattr__(name):
    if name == "LLM":  # imported on first use: `import deltaserve` stays cheap for the CLI's --help
        from deltaserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
