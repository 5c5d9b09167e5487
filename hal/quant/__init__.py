"""hal.quant: calibration observers, QAT and int8 conversion (being written)."""
