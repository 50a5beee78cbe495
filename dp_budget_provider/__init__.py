"""dp-budget-provider: differential-privacy budgets as a gate in Apache Airflow 3 pipelines."""

__version__ = "0.1.0"
