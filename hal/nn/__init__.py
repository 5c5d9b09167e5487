"""hal.nn: fused modules and the fusion pass (being written)."""
