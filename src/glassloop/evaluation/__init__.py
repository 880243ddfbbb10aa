"""Evaluation and prediction in eval mode without gradients: exact averages, metrics by name, the
validation sets of a fit."""
