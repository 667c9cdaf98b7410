"""Code shared by the SSD implementations: the chunking of the scan (`chunks`: padding,
segments, non-finite guards, the skip and gate), the Pallas kernel bodies that the GPU and
TPU backends both run (`kernels`, each backend giving its own block layout; `gpu`, the GPU's
layout and recurrence kernels) and the Hopper chunk kernels in Pallas Mosaic GPU (`mosaic`),
which `ssd`'s and `mamba3`'s `mosaic_gpu` implementations run."""
