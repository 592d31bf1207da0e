"""``pyflyte run``'s command line for our workflows: dashed option names, a help without the
workflow's ``Args:`` block, and our errors as one line.

flytekit derives each option's name from the Python input name, so only ``--train_files`` exists;
our documented interface (and verl users' habits) use dashes. :func:`add_dashed_aliases` wraps
flytekit's option builder to add the dashed spelling as an alias. Each option's help is the
workflow docstring's ``Args:`` entry for it (flytekit reads Google-style docstrings with
``docstring_parser``), so :func:`add_dashed_aliases` also drops that block from the command's own
help, where it would repeat every option's text. These only run inside ``pyflyte run`` (the module
is imported before the options are built) and leave the serialized workflow untouched; if a
flytekit upgrade moves the builder, the alias and the trim silently disappear and the underscore
names keep working.
"""

from __future__ import annotations


def _with_dashed(opt, input_name: str):
    """``opt`` (a click option of the input ``input_name``) also answering to its dashed
    spelling (``--run-name`` beside ``--run_name``)."""
    dashed = f"--{input_name.replace('_', '-')}"
    if "_" in input_name and dashed not in opt.opts and not opt.is_flag:
        opt.opts.append(dashed)
    return opt


def add_dashed_aliases() -> None:
    try:
        from flytekit.clis.sdk_in_container import run as _run
    except ImportError:  # pragma: no cover - flytekit layout changed
        return
    original = _run.to_click_option
    if getattr(original, "_verl_dashed", False):
        return

    def to_click_option(ctx, flyte_ctx, input_name, *args, **kwargs):
        return _with_dashed(original(ctx, flyte_ctx, input_name, *args, **kwargs), input_name)

    to_click_option._verl_dashed = True
    _run.to_click_option = to_click_option

    create = _run.WorkflowCommand._create_command

    def _create_command(self, ctx, entity_name, run_level_params, loaded_entity, *args, **kw):
        cmd = create(self, ctx, entity_name, run_level_params, loaded_entity, *args, **kw)
        doc = getattr(loaded_entity, "__doc__", None)
        if doc and cmd.help and doc in cmd.help:
            cmd.help = cmd.help.replace(doc, description(doc))
        return cmd

    _run.WorkflowCommand._create_command = _create_command


def description(doc: str) -> str:
    """A Google-style docstring without its sections (``Args:`` …): its summary and the
    paragraphs after it, each a paragraph of its own (rich-click joins the lines of one
    paragraph, and ran an ``Args:`` entry into the line before it)."""
    from docstring_parser import ParseError, parse

    try:
        parsed = parse(doc)
    except ParseError:  # flytekit read the same docstring already; never fail a run over help
        return doc
    return "\n\n".join(p for p in (parsed.short_description, parsed.long_description) if p)


def one_line_errors() -> None:
    """Our errors as the one line they were written to be, not under pyflyte's rich traceback
    (~60 lines of frames above the message). A :class:`~verl_core.errors.PermanentError`, or an
    input error of the plain loop's ``USER_ERRORS``, raised in a task prints
    ``pyflyte run: error in <task>: <message>`` on stderr; an input error exits 2 (as the plain
    loop does), another permanent fault 1. Anything else (a bug, flytekit's own errors) keeps
    flytekit's traceback; ``pyflyte -v run …`` shows the traceback of ours too."""
    try:
        from flytekit.clis.sdk_in_container import utils as _utils
    except ImportError:  # pragma: no cover - flytekit layout changed
        return
    original = _utils.pretty_print_exception
    if getattr(original, "_verl_one_line", False):
        return

    def pretty_print_exception(e: Exception, verbosity: int = 1):
        line = one_line(e) if verbosity == 0 else None
        if line is None:
            return original(e, verbosity)
        import sys

        from verl_core.train import USER_ERRORS

        print(f"pyflyte run: error{line}", file=sys.stderr, flush=True)
        sys.exit(2 if isinstance(e, USER_ERRORS) else 1)

    pretty_print_exception._verl_one_line = True
    _utils.pretty_print_exception = pretty_print_exception


def one_line(e: BaseException) -> str | None:
    """`` in <task>: <message>`` for one of our errors, as flytekit re-raised it from a task
    (its message prefixed with ``Error encountered while executing '<task>':``), else None."""
    import re

    from verl_core.errors import PermanentError
    from verl_core.train import USER_ERRORS

    if not isinstance(e, (PermanentError, *USER_ERRORS)):
        return None
    where, text = "", str(e)
    while True:  # flytekit nests the prefix once per scope (task, workflow)
        m = re.match(r"Error encountered while executing '([^']+)':\s*", text)
        if not m:
            break
        where, text = m.group(1), text[m.end():]  # the innermost: the task
    text = " ".join(text.split())  # flytekit's indentation and rich's wrapping
    return f" in {where}: {text}" if where else f": {text}"


def add_dashed_aliases_flyte2() -> None:
    """:func:`add_dashed_aliases` for Flyte 2's ``flyte run`` (workflows/ppo_flyte2.py): its
    option builder (``flyte.cli._run.to_click_option``) also names each option after the Python
    input only; the dashed spelling is added as an alias. Runs when ``flyte run`` imports the
    file, before it builds the options; if a flyte upgrade moves the builder, the underscore
    names keep working."""
    try:
        from flyte.cli import _run
    except ImportError:  # pragma: no cover - flyte layout changed, or flyte not installed
        return
    original = getattr(_run, "to_click_option", None)
    if original is None or getattr(original, "_verl_dashed", False):
        return

    def to_click_option(input_name, *args, **kwargs):
        return _with_dashed(original(input_name, *args, **kwargs), input_name)

    to_click_option._verl_dashed = True
    _run.to_click_option = to_click_option
