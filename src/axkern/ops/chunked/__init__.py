"""The chunked state-space engine that `ssd` (Mamba-2) and `mamba3` both run: a scan with a
per-position log-decay and input scale, computed by chunks (quadratic inside a chunk, a
recurrence over chunk states between chunks). Not an op: the ops' implementations call it.

- `chunks`: plain-JAX pieces every form shares: segments, the recurrence over chunk states, the
  non-finite guard and the layer around a scan (`D`, the gate).
- `scan`: the chunked scan in plain JAX (the `xla` implementations').
- `kernel_scan`: the chunked scan through a backend's Pallas kernels, its `custom_vjp` and SSD's
  layer on it; `layout`: the `Layout` base class that runs each stage; `chunk_state`,
  `chunk_scan`: the Pallas kernel bodies of the chunk states and the chunk outputs, forward and
  backward.
- `pallas_gpu`: the Triton layout (`GpuLayout`, with the recurrence as kernels); `pallas_tpu`:
  the Mosaic TPU layout (`TpuLayout`).
- `mosaic_gpu/`: the Hopper kernels in Pallas Mosaic GPU and the layouts that run them.
"""
