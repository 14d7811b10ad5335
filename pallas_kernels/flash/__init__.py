"""Flash attention kernels: fp32 reference, portable Pallas GPU (Triton), Mosaic TPU."""
