"""Evaluating a family: perplexity, agreement, fixed and hidden questions, lm-eval tasks."""
