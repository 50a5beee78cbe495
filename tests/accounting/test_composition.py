"""RDP composition is exact addition, for any mix of mechanisms and counts."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import (
    GaussianMechanism,
    LaplaceMechanism,
    PureDPMechanism,
    RDPAccountant,
    ZCDPMechanism,
)

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

mechanisms = st.one_of(
    st.floats(0.2, 100.0).map(GaussianMechanism),
    st.floats(1e-3, 50.0).map(LaplaceMechanism),
    st.floats(1e-3, 10.0).map(PureDPMechanism),
    st.floats(1e-6, 10.0).map(ZCDPMechanism),
)
releases = st.lists(st.tuples(mechanisms, st.integers(1, 10_000)), min_size=1, max_size=8)


@settings(max_examples=1500, deadline=None)
@given(releases)
def test_composition_is_elementwise_addition(mix):
    one_by_one = RDPAccountant()
    for mechanism, count in mix:
        one_by_one.compose(mechanism, count)
    expected = sum(count * mechanism.rdp(one_by_one.orders) for mechanism, count in mix)
    np.testing.assert_allclose(one_by_one.rdp, expected, rtol=1e-12, atol=0)

    batched = RDPAccountant()
    batched.compose_many(mix)
    np.testing.assert_allclose(batched.rdp, expected, rtol=1e-12, atol=0)

    # Composing is order-independent.
    reversed_order = RDPAccountant()
    reversed_order.compose_many(reversed(mix))
    np.testing.assert_allclose(reversed_order.rdp, expected, rtol=1e-12, atol=0)


@settings(max_examples=500, deadline=None)
@given(mechanisms, st.integers(1, 200))
def test_k_single_releases_equal_one_k_fold_release(mechanism, k):
    single_steps = RDPAccountant()
    for _ in range(k):
        single_steps.compose(mechanism)
    folded = RDPAccountant()
    folded.compose(mechanism, k)
    np.testing.assert_allclose(single_steps.rdp, k * mechanism.rdp(folded.orders), rtol=1e-12)
    np.testing.assert_allclose(folded.rdp, k * mechanism.rdp(folded.orders), rtol=1e-15)
