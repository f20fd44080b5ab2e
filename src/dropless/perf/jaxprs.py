"""Walking a jaxpr with the jaxprs nested in its equations (``scan``, ``cond``, ``pjit``,
``remat``, ``custom_vjp_call`` bodies), for counts read off a traced program before any
compiler runs: the kernel launches of a step (``tools/count_step_kernels.py``), the
quantizations and attention forwards a remat policy leaves in a gradient (the tests of
``train.remat``)."""

from collections import Counter
from typing import Iterator


def sub_jaxprs(eqn) -> Iterator:
    """The jaxprs in ``eqn``'s parameters (a ``ClosedJaxpr``'s ``.jaxpr``), in order."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
            if hasattr(sub, "eqns"):
                yield sub


def equations(jaxpr) -> Iterator:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it, depth first (a scan's
    body once, whatever its length)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from equations(sub)


def primitive_counts(jaxpr) -> Counter:
    """Counter of primitive names over ``equations(jaxpr)``."""
    return Counter(eqn.primitive.name for eqn in equations(jaxpr))
