"""Code the chunked Mamba-3 implementations share (not an implementation; each backend supplies
the chunk scan):

- `layer`: the layer through a chunk scan (`forward`, its `Core` protocol): the chunked form,
  the non-finite guard and the output's correction, skip, gate and rank collapse.
- `kernel_core`: the engine's Pallas chunk kernels as a `Core` (MIMO ranks as kernel positions).
- `rotation`: the rotation of `q` and `k` by the angles, its backward, and the rotated pairs'
  products.
- `angles`: the angles `Θ` by XLA's passes; `angle_kernel`: by one Pallas Triton kernel.
"""
