"""Only ``shardwise.models`` knows a model: no other module of ``src/`` names a model class or a model
type, or imports a model's module (``shardwise.models.gpt``, ``shardwise.models.mlp``) or transformers'
model code (``transformers.models``); each asks the model's adapter (``shardwise.models.adapters``).

Read from the source (``ast``): identifiers and imported names against the classes defined in the
built-in models' modules and Hugging Face's naming (``GPT2...``, ``Llama...``, ``...ForCausalLM``,
``...LMHeadModel``); string literals (docstrings aside: prose may name a model) against the model
types (``"gpt2"``, ``"llama"``, the built-in kinds ``"gpt"`` / ``"mlp"``, the families' names, the
shipped configs) and against Hugging Face class names inside them. ``config.py`` alone may write the
built-in kinds: it is the schema that says which kinds a user may give (``model.kind = "gpt"`` is its
default) and it sits below the models. The same rule for imports is an import-linter contract too
(pyproject.toml), for the modules it lists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from shardwise.models.adapters import FAMILIES
from shardwise.models.hf import shipped_configs

SRC = Path(__file__).resolve().parents[2] / "src" / "shardwise"
MODELS = SRC / "models"
KINDS_ALLOWED_IN = {SRC / "config.py"}  # the schema: the built-in kinds a user may write
BUILT_IN_KINDS = {"gpt", "mlp"}
FORBIDDEN_IMPORTS = ("shardwise.models.gpt", "shardwise.models.mlp", "transformers.models")
HF_CLASS = re.compile(r"^(GPT2|Llama)[A-Z]\w*$|^\w+(ForCausalLM|LMHeadModel)$")
HF_CLASS_IN_TEXT = re.compile(r"\b((GPT2|Llama)[A-Z]\w*|\w+(ForCausalLM|LMHeadModel))\b")


def _built_in_classes() -> set[str]:
    """Every class the built-in models' modules define (``GPT``, ``Block``, ``MLP``, ...)."""
    names = set()
    for module in ("gpt.py", "mlp.py"):
        tree = ast.parse((MODELS / module).read_text())
        names |= {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    return names


CLASSES = _built_in_classes()
MODEL_TYPES = (
    BUILT_IN_KINDS
    | {"gpt2", "llama"}  # Hugging Face's model_type of the families with an adapter
    | {family.name for family in FAMILIES}
    | {name for config in shipped_configs() for name in (config, f"hf:{config}")}
)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _is_class(name: str) -> bool:
    return name in CLASSES or bool(HF_CLASS.match(name))


def offences(source: str, kinds_allowed: bool = False) -> list[str]:
    """What in ``source`` names a model: ``line: what``."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{line}: imports {m}" for m in modules if m.startswith(FORBIDDEN_IMPORTS)]
            found += [f"{line}: imports {a.name}" for a in node.names if _is_class(a.name)]
        elif isinstance(node, ast.Name) and _is_class(node.id):
            found.append(f"{line}: names {node.id}")
        elif isinstance(node, ast.Attribute) and _is_class(node.attr):
            found.append(f"{line}: names {node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
            allowed = BUILT_IN_KINDS if kinds_allowed else set()
            if text.lower() in MODEL_TYPES - allowed:
                found.append(f"{line}: the model type {text!r}")
            found += [f"{line}: names {m.group(1)} in {text!r}" for m in HF_CLASS_IN_TEXT.finditer(text)]
    return found


def test_no_module_outside_models_names_a_model() -> None:
    report = {}
    for path in sorted(SRC.rglob("*.py")):
        if MODELS in path.parents:
            continue
        if found := offences(path.read_text(), kinds_allowed=path in KINDS_ALLOWED_IN):
            report[str(path.relative_to(SRC))] = found
    assert report == {}, "ask the model's adapter (shardwise.models.adapters) instead"


def test_the_check_finds_each_way_of_naming_a_model() -> None:
    """Each kind of reintroduction is caught (so the test above can fail)."""
    cases = {
        "from shardwise.models.gpt import GPT": ["1: imports shardwise.models.gpt", "1: imports GPT"],
        "import transformers.models.llama.modeling_llama as m": [
            "1: imports transformers.models.llama.modeling_llama"
        ],
        "from shardwise.models import MLP": ["1: imports MLP"],
        "ok = isinstance(model, transformers.GPT2LMHeadModel)": ["1: names GPT2LMHeadModel"],
        "ok = isinstance(model, LlamaForCausalLM)": ["1: names LlamaForCausalLM"],
        "ok = config.model_type == 'llama'": ["1: the model type 'llama'"],
        "ok = kind == 'gpt'": ["1: the model type 'gpt'"],
        "ok = family == 'hf-gpt2'": ["1: the model type 'hf-gpt2'"],
        "kind = 'hf:tiny-llama'": ["1: the model type 'hf:tiny-llama'"],
        "why = 'runs GPT2Model and MistralForCausalLM'": [
            "1: names GPT2Model in 'runs GPT2Model and MistralForCausalLM'",
            "1: names MistralForCausalLM in 'runs GPT2Model and MistralForCausalLM'",
        ],
    }
    for source, expected in cases.items():
        assert offences(source) == expected, source
    assert offences("kind = 'gpt'", kinds_allowed=True) == []
    prose = '"""The built-in GPT, Hugging Face GPT2LMHeadModel and Llama."""\nwhy = "a Llama-style config"'
    assert offences(prose) == []
