"""Flyte tasks: one file per phase. Thin adapters: load refs -> call verl_core -> return refs."""
