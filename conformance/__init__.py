"""hal.conformance: the conformance suite (being written)."""
