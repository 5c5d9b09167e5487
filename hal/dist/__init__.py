"""hal.dist: collectives on torch.distributed (being written)."""
