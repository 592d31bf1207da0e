"""Attaching the run reports (``verl_core.report``) to tasks as Flyte Decks."""

import flytekit
from flytekit import Deck
from flytekit.deck import DeckField

REPORT_DECK_FIELDS = (DeckField.INPUT, DeckField.OUTPUT, DeckField.TIMELINE)
"""flytekit's own decks shown next to the report (not Dependencies: two pip runs per task)."""

OUR_DECKS = ("RL run", "Step")


def attach(name: str, html: str, *, only: bool = False) -> None:
    """Show ``html`` in the task's Deck tab ``name``. In a local run flytekit keeps one deck list
    for every task of the execution (the decks of earlier tasks would reappear in this one's
    page), so ours from earlier tasks are dropped first; on a cluster the list is this task's.
    ``only``: drop flytekit's decks too (a task with ``deck_fields=()``, whose page is this card
    alone; locally it would otherwise re-render an earlier task's Input/Output and the whole
    execution's Timeline, which grows with every task, on every step)."""
    decks = flytekit.current_context().decks
    decks[:] = [] if only else [d for d in decks if d.name not in (*OUR_DECKS, name)]
    Deck(name, html)
