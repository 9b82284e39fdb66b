"""nanopt: a command-line toolkit for pretraining decoder-only language models with PyTorch."""

__version__ = "0.1.0"
