"""The ``dp-release://`` asset scheme: Airflow normalises it through the provider's
registered handler, and refuses a URI that does not name one release."""

from __future__ import annotations

import pytest
from airflow.sdk import Asset


def test_airflow_normalises_a_dp_release_uri_through_the_registered_handler():
    asset = Asset(name="visits", uri="dp-release://acme/weekly/visit-counts/")
    assert asset.uri == "dp-release://acme/weekly/visit-counts"
    assert asset.normalized_uri == asset.uri  # None if no provider registered the scheme


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("dp-release://acme", "needs a name"),
        ("dp-release://acme/", "needs a name"),
        ("dp-release:///visit-counts", "needs a namespace"),
        ("dp-release://acme/visit-counts?week=1", "no query or fragment"),
    ],
)
def test_a_uri_that_names_no_single_release_is_refused(uri, problem):
    with pytest.raises(ValueError, match=problem):
        Asset(name="visits", uri=uri)
