"""Seeing inside a run: the per-rank monitor, the hang watchdog, traces and plots."""
