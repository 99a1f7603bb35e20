"""Benchmarks and comparisons that run whole jobs: ours against PyTorch's built-ins, interleaved.

They sit above the training loop (they launch it) and below the command line; the communication
patterns are those of the strategies they run.
"""
