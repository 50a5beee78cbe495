"""OpenLineage for the release operators: imported only from their lineage methods, so
the provider works without ``apache-airflow-providers-openlineage`` installed."""
