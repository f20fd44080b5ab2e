"""dropless: dropless Mixture-of-Experts training in JAX.

Layers (imports point downward only): ``config`` -> ``nn`` / ``train`` ->
``parallel`` -> ``ops``. Kernels in ``ops`` take arrays and static ints,
never config objects.
"""

__version__ = "0.1.0"
