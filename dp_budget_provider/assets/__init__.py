"""The provider's asset URI scheme (registered under ``asset-uris`` in its provider info)."""
