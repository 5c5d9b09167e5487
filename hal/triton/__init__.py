"""hal.triton: portable Triton kernel sources shared by the GPU plugins (being written)."""
