"""Complex PRODUCT / AVG keep infinities where the value is exact (issue 21.8): a redistribute through
``Partial(product)`` or ``Partial(avg)`` never changes a complex value, and AVG divides each part by the group
size (``(inf+0j) / 2`` is ``inf+0j``, not the ``inf+nanj`` of a complex division by ``2+0j``)."""

import warnings

import numpy as np
import pytest

import spmd
from spmd import Partial, Replicate, Shard

SPECIAL = np.array([complex(np.inf, 0), complex(0, np.inf), complex(-np.inf, 2), complex(3, -np.inf), 1 + 2j,
                    complex(np.nan, 0)], np.complex64)


def _same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.real, want.real)  # nan == nan here; inf must stay inf
    np.testing.assert_array_equal(got.imag, want.imag)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("op", ["product", "avg"])
def test_redistribute_through_a_partial_keeps_a_complex_value(n, op):
    mesh = spmd.init_device_mesh("cpu", (n,))
    r = spmd.distribute_tensor(SPECIAL, mesh, [Replicate()])
    _same(r.redistribute(placements=[Partial(op)]).redistribute(placements=[Replicate()]).full_tensor(), SPECIAL)
    _same(spmd.distribute_tensor(SPECIAL, mesh, [Partial(op)]).full_tensor(), SPECIAL)
    tiled = np.tile(SPECIAL, n)
    s = spmd.distribute_tensor(tiled, mesh, [Shard(0)])
    _same(s.redistribute(placements=[Partial(op)]).full_tensor(), tiled)


def test_complex_avg_divides_each_part():
    mesh = spmd.init_device_mesh("cpu", (2,))
    x = np.stack([SPECIAL, np.full_like(SPECIAL, 1 + 1j)])  # rank r holds x[r]
    total = x[0] + x[1]
    want = np.empty_like(total)
    want.real, want.imag = total.real / np.float32(2), total.imag / np.float32(2)
    got = mesh.get_group(0).allreduce(x.reshape(2, 1, -1), "avg")
    _same(np.asarray(got)[0, 0], want)
    assert np.asarray(got)[0, 0, 0] == complex(np.inf, 0.5)


def test_complex_product_of_non_identity_factors_is_ieee():
    # Only an exact 1+0j factor is skipped; other factors multiply as NumPy does.
    mesh = spmd.init_device_mesh("cpu", (2,))
    x = np.stack([SPECIAL, np.full_like(SPECIAL, 2 - 1j)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = x[0] * x[1]
    _same(np.asarray(mesh.get_group(0).allreduce(x.reshape(2, 1, -1), "product"))[0, 0], want)
