"""Every subject's account as plain SQL, for tests that read (or tamper with) the tables.

Written independently of ``dp_budget_provider.ledger.accounts.memberships``: a ``dp_members`` row,
or a member of the cohort a class refers to (``dp_accounts.cohort_id``).
"""

MEMBERS = (
    '(SELECT tenant, query_type, "window", subject, account FROM dp_members UNION ALL '
    'SELECT a.tenant, a.query_type, a."window", r.subject, a.subject AS account '
    "FROM dp_accounts a JOIN dp_cohort_members r ON r.cohort_id = a.cohort_id)"
)
