"""Which model family a model belongs to, decided by the forward it runs.

The pipeline split (``pipeline/split.py``) replays a family's forward piece by piece (embedding,
blocks, head), and tensor parallelism's plans (``tensor_parallel/plans.py``) are written for what a
family's forward hands each layer. Both must run the model's own code, so a model belongs to a family
only when its forward *is* the family's: its class is the family's class, or a subclass that does not
override ``forward``, and the body that forward calls (Hugging Face's ``transformer`` / ``model``)
keeps its own forward too. A subclass whose forward differs (it scales the logits, say) is refused
in one line naming the class, never trained as its parent. Families: the built-in GPT, and Hugging
Face ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` (looked up only when transformers is already
imported: a model of it was built). No communication.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from shardwise.config import ConfigError

GPT, HF_GPT2, HF_LLAMA = "gpt", "hf-gpt2", "hf-llama"


@dataclass(frozen=True)
class Family:
    """A family: its name, its class, and the body module (path, class) whose forward its forward calls."""

    name: str
    root: type[nn.Module]
    body: tuple[str, type[nn.Module]] | None = None


def families() -> list[Family]:
    """The families the pipeline and tensor parallelism run (the Hugging Face ones when imported)."""
    from shardwise.models.gpt import GPT as BuiltInGPT

    found = [Family(GPT, BuiltInGPT)]
    gpt2 = sys.modules.get("transformers.models.gpt2.modeling_gpt2")
    if gpt2 is not None:
        found.append(Family(HF_GPT2, gpt2.GPT2LMHeadModel, ("transformer", gpt2.GPT2Model)))
    llama = sys.modules.get("transformers.models.llama.modeling_llama")
    if llama is not None:
        found.append(Family(HF_LLAMA, llama.LlamaForCausalLM, ("model", llama.LlamaModel)))
    return found


def _own_forward(module: nn.Module, parent: type[nn.Module]) -> bool:
    """Whether ``module`` runs ``parent.forward``: not overridden by its class nor set on the instance."""
    return type(module).forward is parent.forward and "forward" not in vars(module)


def family_of(
    model: nn.Module, why: str, fix: str, error: type[ConfigError] = ConfigError
) -> str | None:
    """The name of ``model``'s family, or None when it is none of them. A subclass of a family whose
    forward (or whose body's forward) is not the family's raises ``error``: ``<class>.forward
    overrides <family class>.forward, and <why>; <fix>``."""
    for family in families():
        if not isinstance(model, family.root):
            continue
        name = type(model).__name__
        if not _own_forward(model, family.root):
            raise error(f"{name}.forward overrides {family.root.__name__}.forward, and {why}; {fix}")
        if family.body is not None:
            path, body_class = family.body
            body = getattr(model, path, None)
            if isinstance(body, nn.Module) and not _own_forward(body, body_class):
                raise error(
                    f"{name}.{path} is a {type(body).__name__}, whose forward overrides "
                    f"{body_class.__name__}.forward, and {why}; {fix}"
                )
        return family.name
    return None
