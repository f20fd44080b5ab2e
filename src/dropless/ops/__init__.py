"""Pure JAX functions: grouped matmul, routing, permutation. No Flax, no configs."""
