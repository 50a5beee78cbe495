"""The budget UI: an Airflow plugin with a FastAPI app at ``/dp-budget`` and a task link.

``links`` is imported by the release operator (task side, light); ``app`` and
``dp_budget`` only by Airflow's plugin manager and the API server.
"""
