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


def ours_first_and_announced() -> None:
    """Every Deck page opens on our tab: flytekit renders the tabs in list order and adds its
    Timeline before the task body runs, so the page opened on it. Locally, the run report's page
    (finalize's) is also announced on the console with its path: flytekit only logs it at INFO,
    under a random ``/tmp/flyte-*`` folder. Wraps flytekit's ``_output_deck`` (called by name at
    render time, locally and on a cluster); if a flytekit upgrade moves it, the tabs keep
    flytekit's order and the path goes unannounced, nothing else changes."""
    import os

    from flytekit.core.context_manager import ExecutionState, FlyteContext
    from flytekit.deck import deck as _deck

    original = getattr(_deck, "_output_deck", None)
    if original is None or getattr(original, "_verl", False):
        return

    def _output_deck(task_name, new_user_params):
        decks = new_user_params.decks
        decks.sort(key=lambda d: d.name not in OUR_DECKS)  # stable: ours first, the rest as was
        ctx = FlyteContext.current_context()
        local = ctx.execution_state is None or \
            ctx.execution_state.mode != ExecutionState.Mode.TASK_EXECUTION
        if not (local and task_name.startswith("finalize") and
                any(d.name == "RL run" for d in decks)):
            return original(task_name, new_user_params)
        path = os.path.join(ctx.file_access.get_random_local_directory(), _deck.DECK_FILE_NAME)
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(_deck._get_deck(new_user_params=new_user_params, ignore_jupyter=True))
        except OSError as e:  # as flytekit's own: a report that cannot be written fails nothing
            print(f"[verl] could not write the run report: {e}", flush=True)
            return
        from flytekit.loggers import logger

        logger.info(f"{task_name} task creates flyte deck html to file://{path}")  # as flytekit
        print(f"[verl] run report (Flyte Deck: reward, accuracy, KL, samples, guard events): "
              f"file://{path}", flush=True)

    _output_deck._verl = True
    _deck._output_deck = _output_deck


ours_first_and_announced()
