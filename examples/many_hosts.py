"""A training step of axkern's named ops over the devices of several processes (one per host).

Every process runs this same program (SPMD). It joins the cluster, builds one mesh over all
processes' devices (`data` across processes, `model` inside each), loads only its own rows
of the batch, and runs a short convolution and the vocab-parallel fused cross-entropy under
a haliax axis mapping. Process 0 prints the loss, the gradient norm, the same loss computed
on one device from the whole batch, and what `axkern.explain` chose for one shard.

Two processes on one machine, 4 CPU devices each (docs/many-hosts.md):

    export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4
    python examples/many_hosts.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1 &
    python examples/many_hosts.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0

Under SLURM, Open MPI, Kubernetes or on Cloud TPU, leave the three flags out: JAX finds them
(and gives each process one GPU unless JAX_LOCAL_DEVICE_IDS names them all).
"""

from __future__ import annotations

import argparse

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import axkern

Batch, Pos, Embed, Vocab = (
    hax.Axis("batch", 16),
    hax.Axis("position", 32),
    hax.Axis("embed", 64),
    hax.Axis("vocab", 512),
)
Width = hax.Axis("width", 4)
# batch rows across processes (hosts), the vocabulary across the devices of each process
MAPPING = {"batch": "data", "vocab": "model"}


def loss_fn(params, x, labels):
    h = axkern.short_conv(x, params["conv"], Channel="embed", activation="silu")
    return axkern.fused_cross_entropy(h, params["lm_head"], labels, Embed="embed", Vocab="vocab")


def init(key):
    k_conv, k_head = jax.random.split(key)
    return {
        "conv": hax.random.normal(k_conv, (Width, Embed)) * 0.5,
        "lm_head": hax.random.normal(k_head, (Embed, Vocab)) * Embed.size**-0.5,
    }


def whole_batch(seed=0):
    """The batch as numpy; every process makes the same one here, a real loader reads only its rows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((Batch.size, Pos.size, Embed.size), dtype=np.float32)
    labels = rng.integers(0, Vocab.size, (Batch.size, Pos.size), dtype=np.int32)
    return x, labels


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0],
        epilog="Under SLURM, Open MPI, Kubernetes or on Cloud TPU leave the three flags out: JAX finds them.",
    )
    parser.add_argument("--coordinator", help="HOST:PORT of process 0")
    parser.add_argument("--num-processes", type=int, help="how many processes the cluster has")
    parser.add_argument("--process-id", type=int, help="this process's index, 0 to num-processes - 1")
    args = parser.parse_args()
    flags = (args.coordinator, args.num_processes, args.process_id)
    if any(f is not None for f in flags) and any(f is None for f in flags):
        parser.error("give all three of --coordinator, --num-processes and --process-id, or none")
    try:
        jax.distributed.initialize(*flags)
    except ValueError as e:  # no flags and no cluster JAX recognises
        parser.error(
            f"no cluster to join ({e}): give --coordinator, --num-processes and --process-id "
            "(two processes on one machine: see docs/many-hosts.md), or run under a cluster manager"
        )

    processes, local = jax.process_count(), jax.local_device_count()
    if processes > 1:  # each process's devices form one row: `data` is the only axis that crosses hosts
        devices = mesh_utils.create_hybrid_device_mesh((1, local), (processes, 1), process_is_granule=True)
    else:
        devices = np.array(jax.devices()).reshape(1, local)
    mesh = Mesh(devices, ("data", "model"))

    x_all, labels_all = whole_batch()
    rows = Batch.size // processes
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(MAPPING):
        # this process's rows become its part of one global array
        x = hax.named(
            jax.make_array_from_process_local_data(
                NamedSharding(mesh, PartitionSpec("data")), x_all[mine], x_all.shape
            ),
            (Batch, Pos, Embed),
        )
        labels = hax.named(
            jax.make_array_from_process_local_data(
                NamedSharding(mesh, PartitionSpec("data")), labels_all[mine], labels_all.shape
            ),
            (Batch, Pos),
        )
        params = hax.named_jit(init, axis_resources=MAPPING)(jax.random.PRNGKey(0))  # lm_head split by vocab
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, x, labels)
        grad_norm = jnp.sqrt(
            sum(jnp.sum(g.array**2) for g in jax.tree.leaves(grads, is_leaf=hax.is_named_array))
        )
        decision = axkern.explain(loss_fn, params, x, labels)

    # the same loss on this process's first device, from the whole batch (no mesh, no mapping)
    with jax.default_device(jax.local_devices()[0]):
        local_params = jax.tree.map(lambda a: multihost_utils.process_allgather(a, tiled=True), params)
        one_device = loss_fn(
            local_params,
            hax.named(jnp.asarray(x_all), (Batch, Pos, Embed)),
            hax.named(jnp.asarray(labels_all), (Batch, Pos)),
        )
    if jax.process_index() == 0:
        print(f"{processes} processes, {jax.device_count()} devices, mesh {dict(mesh.shape)}")
        print(
            f"loss {float(loss):.6f} (one device: {float(one_device):.6f}), gradient norm {float(grad_norm):.6f}"
        )
        for d in decision if isinstance(decision, tuple) else (decision,):
            print(d)


if __name__ == "__main__":
    main()
