"""Hyperparameter search (``glassloop tune``, :func:`glassloop.tune`), an Optuna study whose
trials are normal glassloop runs (:mod:`glassloop.tuning.sweep`) over the keys, ranges and
choices of a SPACE.toml (:mod:`glassloop.tuning.space`). Optuna is imported only here, when a
sweep starts: ``pip install 'glassloop[search]'``."""
