"""Pallas Mosaic GPU grouped matmul kernels for Hopper (placeholder until built)."""


def is_available():
    """True when a Hopper (sm_90) GPU is the default device."""
    return False


def supports(x_shape, w_shape, dtype):
    return False
