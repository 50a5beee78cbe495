"""The pipelined write transaction: failures roll everything back and leave the pool usable."""

from __future__ import annotations

import pytest

from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger
from dp_budget_provider.ledger.storage import database, pipeline


@pytest.fixture
def engine(ledger_url):
    PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=ledger_url).close()
    engine = database.make_engine(ledger_url)
    yield engine
    engine.dispose()


def _head(engine) -> list[tuple]:
    with pipeline.write(engine) as pipe:
        return [tuple(row) for row in pipe.query("SELECT id, seq FROM dp_chain_head")]


def test_a_failing_deferred_write_rolls_back_and_the_connection_is_reused_cleanly(engine):
    """Only queued writes, one of them failing at commit: nothing stays, the pool is fine."""
    before = _head(engine)
    with pytest.raises(pipeline.UniqueViolation), pipeline.write(engine) as pipe:
        pipe.send("UPDATE dp_chain_head SET seq = seq + 100 WHERE id = 1")
        pipe.send("INSERT INTO dp_chain_head (id, seq, hash) VALUES (1, 0, 'duplicate')")
    for _ in range(3):  # every pooled connection answers, none is stuck in a failed block
        assert _head(engine) == before


def test_an_exception_in_the_block_rolls_back_what_ran(engine):
    """A refusal raised after the lock-and-read statement leaves no trace."""
    before = _head(engine)
    with pytest.raises(RuntimeError, match="refused"), pipeline.write(engine) as pipe:
        pipe.query("UPDATE dp_chain_head SET seq = seq + 100 WHERE id = 1")
        raise RuntimeError("refused")
    assert _head(engine) == before
