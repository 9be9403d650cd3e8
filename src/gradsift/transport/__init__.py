"""Transports: how the workers' payloads become the mean gradient (in-process, or torch.distributed)."""
