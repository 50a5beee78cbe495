"""``dp-release://<namespace>/<name>``: an Asset that names a published DP release.

A release's output is often a value, not a file or a table (the noisy answer in XCom, or
wherever a downstream task puts it), so its outlet Asset needs a name that says what it
is. This scheme gives one, and registers it with Airflow (the provider info's
``asset-uris``) so that Airflow normalises it and OpenLineage names it like any other
dataset: namespace ``dp-release://<namespace>`` (the tenant, say), name ``<name>``. The
releases that write a real table or file use that store's own URI instead (``postgres://``,
``s3://``, ``file://``), and its provider names it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, urlsplit

if TYPE_CHECKING:
    from airflow.sdk import Asset

SCHEME = "dp-release"


def sanitize_uri(uri: SplitResult) -> SplitResult:
    """The URI as Airflow stores it, or ValueError: a namespace and a name are required,
    and a query or fragment would make two names for one release."""
    if not uri.netloc:
        raise ValueError(f"a {SCHEME}:// URI needs a namespace: {SCHEME}://<namespace>/<name>")
    if not uri.path.strip("/"):
        raise ValueError(f"a {SCHEME}:// URI needs a name: {SCHEME}://<namespace>/<name>")
    if uri.query or uri.fragment:
        raise ValueError(f"a {SCHEME}:// URI has no query or fragment")
    return uri._replace(path="/" + uri.path.strip("/"))


def convert_asset_to_openlineage(asset: Asset, lineage_context: Any) -> Any:
    """The OpenLineage dataset of a ``dp-release://`` Asset (called by the OpenLineage
    provider, so it is installed when this runs)."""
    from airflow.providers.common.compat.openlineage.facet import Dataset

    parsed = urlsplit(asset.uri)
    return Dataset(namespace=f"{SCHEME}://{parsed.netloc}", name=parsed.path.lstrip("/"))
