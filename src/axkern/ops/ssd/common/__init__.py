"""Code shared by the SSD implementations: the chunking of the scan (`chunks`: padding,
segments, non-finite guards, the skip and gate) and the Pallas kernel bodies that the GPU and
TPU backends both run (`kernels`, each backend giving its own block layout)."""
