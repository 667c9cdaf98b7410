"""Mesh placement under a haliax axis mapping: partition specs, the blocks' mesh axes, the checks."""

from __future__ import annotations

import haliax as hax
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from axkern.core import mesh

T, X, E = hax.Axis("token", 8), hax.Axis("experts", 4), hax.Axis("embed", 6)
AXES = {"Experts": X, "Embed": E}


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "ep"))


def test_mesh_axes_outside_a_mapping_are_none():
    assert mesh.mesh_axes_for(T) is None
    assert mesh.batch_mesh((T,)) == ()
    assert mesh.partition_spec(("batch", "Embed"), (T,), AXES, {"Embed"}) == PartitionSpec(None, None)


def test_partition_spec_splits_the_batch_and_the_split_roles_only():
    with hax.axis_mapping({"token": ("data", "ep"), "embed": "ep", "experts": "ep"}):
        assert mesh.batch_mesh((T,)) == ("data", "ep")
        spec = mesh.partition_spec(("batch", "Embed", "Experts"), (T,), AXES, {"Experts"})
        assert spec == PartitionSpec(("data", "ep"), None, "ep")


def test_with_batch_axis_takes_the_batch_mesh_axes_its_array_leaves_free():
    # expert-parallel counts [Blocks, Experts]: experts on "ep", so the blocks go over "data" only
    with hax.axis_mapping({"token": ("data", "ep"), "experts": "ep"}):
        spec = mesh.partition_spec(("Blocks", "Experts"), (T,), AXES, {"Experts"}, with_batch={"Blocks"})
        assert spec == PartitionSpec(("data",), "ep")
        assert mesh.blocks_mesh((T,), [X]) == ("data",)
        assert mesh.blocks_mesh((T,), []) == ("data", "ep")
        alone = mesh.partition_spec(("Blocks",), (T,), AXES, (), with_batch={"Blocks"})
        assert alone == PartitionSpec(("data", "ep"))


def test_check_mapping_names_the_axis_that_does_not_divide_and_the_shared_mesh_axis():
    with (
        hax.partitioning.set_mesh(_mesh()),
        hax.axis_mapping({"token": "data", "experts": "ep", "embed": "ep"}),
    ):
        mesh.check_mapping("op", {"x": [(T, True), (E, False)], "w": [(X, True)]})
        with pytest.raises(ValueError, match="x's axis embed=6 is mapped to mesh axis 'ep' of size 4"):
            mesh.check_mapping("op", {"x": [(T, True), (E, True)]})
        with pytest.raises(ValueError, match="axes 'experts' and 'embed' are both mapped to mesh axis 'ep'"):
            mesh.check_mapping("op", {"w": [(X, True)], "x": [(hax.Axis("embed", 8), True)]})
        mesh.check_mapping(
            "op",
            {"w": [(X, True)], "x": [(hax.Axis("embed", 8), True)]},
            {"experts", "embed"},
            "Experts+Embed",
        )
