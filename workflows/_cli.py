"""Dashed option names for ``pyflyte run`` (``--train-files`` as well as ``--train_files``).

flytekit derives each option's name from the Python input name, so only ``--train_files`` exists;
our documented interface (and verl users' habits) use dashes. This wraps flytekit's option builder
to add the dashed spelling as an alias. It only runs inside ``pyflyte run`` (the module is
imported before the options are built) and leaves the serialized workflow untouched; if a
flytekit upgrade moves the builder, the alias silently disappears and the underscore names keep
working.
"""

from __future__ import annotations


def add_dashed_aliases() -> None:
    try:
        from flytekit.clis.sdk_in_container import run as _run
    except ImportError:  # pragma: no cover - flytekit layout changed
        return
    original = _run.to_click_option
    if getattr(original, "_verl_dashed", False):
        return

    def to_click_option(ctx, flyte_ctx, input_name, *args, **kwargs):
        opt = original(ctx, flyte_ctx, input_name, *args, **kwargs)
        dashed = f"--{input_name.replace('_', '-')}"
        if "_" in input_name and dashed not in opt.opts and not opt.is_flag:
            opt.opts.append(dashed)
        return opt

    to_click_option._verl_dashed = True
    _run.to_click_option = to_click_option
