"""podtrain: pre-train language models with PyTorch DistributedDataParallel, FSDP2 or HSDP."""

__version__ = "0.1.0"
