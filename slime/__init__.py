"""slime: an LLM post-training framework for RL scaling."""

__version__ = "0.1.0"
