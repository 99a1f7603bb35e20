"""The planner: will a layout fit, and which is fastest? Arithmetic only; it runs nothing.

``model`` reads a model's sizes (a preset, a Hugging Face config, or by hand); ``layout`` holds the
run and the mesh and counts the model states per rank, ``activations`` what a block saves, and
``memory`` counts one rank's bytes by component for a strategy and mesh; ``time`` predicts a step
from FLOPs and the collectives' cost model; ``search`` enumerates layouts for a target machine, drops
those that do not fit and ranks the rest. No communication anywhere in this package.
"""
