"""podtrain: pre-train language models with PyTorch DistributedDataParallel."""

__version__ = "0.1.0"
