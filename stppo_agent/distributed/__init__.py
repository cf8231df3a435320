"""Multi-process training: the torch.distributed process group and the per-node shared retrieval server."""
