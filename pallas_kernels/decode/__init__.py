"""Split-KV decode kernels: fp32/jnp reference, portable Pallas GPU (Triton), Mosaic TPU."""
