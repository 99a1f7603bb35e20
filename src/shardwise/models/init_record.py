"""Build a model on the meta device while recording how each of its tensors is initialised.

Inside ``with Recorder() as rec:`` a model's constructor runs as usual, but nothing is allocated:

* ``torch.empty`` without a device makes meta tensors (what ``nn.Linear``, ``nn.Embedding`` and most
  layers allocate their parameters with), and ``nn.Module.register_parameter`` moves any parameter that
  arrives with values (``torch.ones``, a computed tensor) to meta, keeping those values as its first
  operation (a constant as a ``fill_``);
* a ``TorchFunctionMode`` sees every in-place operation on a meta tensor and records it against the
  tensor's storage, with the region it wrote (a view of a parameter writes a box of it): random draws
  (``normal_``, ``uniform_``, ... with the arguments the initialiser computed from the global shape,
  fan-in included) and elementwise ones (``fill_``, ``zero_``, ``mul_``, ``clamp_``, ...);
* ``torch.nn.init``'s functions that skip meta tensors are wrapped (in torch and in the copies
  ``transformers.initialization`` keeps): ``trunc_normal_`` is recorded as a draw; ``orthogonal_``,
  ``sparse_``, ``eye_`` and ``dirac_`` are not elementwise and are recorded as calls, replayed on the
  whole tensor.

Hugging Face models initialise in ``post_init`` through ``_init_weights`` (transformers skips that only
under a meta *default device*, which this is not), so what they do is recorded too. ``finish(model)``
turns the records into an :class:`InitRecord`: every meta parameter and buffer by its first name (a
tied tensor once, under its owner's name), its ops with regions as boxes of its shape, the seed (the
caller's ``torch.initial_seed()``), and what could not be recorded. :mod:`shardwise.models.init_replay`
replays it on any part. No communication.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from shardwise.checkpoint.boxes import Box, unravel
from shardwise.device import HOST

META = torch.device("meta")

DRAWS = {
    "normal_", "uniform_", "bernoulli_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_",
}  # fmt: skip
POINTWISE = {
    "fill_", "zero_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_",
    "abs_", "neg_", "exp_", "log_", "sqrt_", "pow_", "sign_", "tanh_", "sigmoid_", "reciprocal_",
    "floor_", "ceil_", "round_", "trunc_", "fmod_", "remainder_",
}  # fmt: skip
# in-place by name, but they change a tensor's metadata or autograd flags, not its values
NOT_WRITES = {
    "requires_grad_", "retain_grad", "detach_", "share_memory_", "resize_", "resize_as_", "set_",
    "as_strided_", "transpose_", "t_", "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_", "record_stream",
}  # fmt: skip
CHUNKED_CALLS = ("trunc_normal_",)  # elementwise draws torch skips on meta: replayed chunk by chunk
WHOLE_CALLS = ("orthogonal_", "sparse_", "eye_", "dirac_")  # not elementwise: replayed on the whole
# torch.nn.init functions that reach a TorchFunctionMode as one call (their inner ops unseen): each is
# recorded as the op it stands for; those that skip meta tensors (above) are wrapped instead; the
# others' tensor ops are seen one by one
# (transformers' guard swaps its own copies into torch.nn.init while it initialises: the same names)
DISPATCHED = ("uniform_", "normal_", "constant_", "kaiming_uniform_")
INIT_MODULES = ("torch.nn.init", "transformers.initialization")


@dataclass(frozen=True)
class Region:
    """Where an op wrote, in its storage: ``as_strided(sizes, strides, offset)``."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @staticmethod
    def of(t: torch.Tensor) -> Region:
        return Region(int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))


@dataclass(frozen=True)
class Op:
    """One recorded operation. ``kind``: ``draw`` (random, or a chunked call), ``pointwise``,
    ``value`` (computed data), ``whole`` (a call on the whole tensor) or ``unknown`` (not replayable).
    ``box``: the region as a box of the tensor (None: strided, replayable whole only)."""

    kind: str
    name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    region: Region | None = None
    box: Box | None = None
    fn: Callable[..., Any] | None = None
    data: torch.Tensor | None = None  # ``value``: the region's values, on the host


@dataclass
class TensorInit:
    """How one tensor is initialised: its global shape and draw dtype, ops in order, whether it is
    replayed whole (a non-elementwise call, or a region that is no box), and where it lives."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    ops: list[Op]
    whole: bool = False
    problem: str = ""  # why it cannot be replayed ("" when it can)


@dataclass
class InitRecord:
    """Every meta tensor of a model by its first name; ``aliases``: every name -> the first."""

    seed: int
    tensors: dict[str, TensorInit] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def notes(self) -> list[str]:
        """One line per tensor drawn whole or given computed values, and per tensor never written."""
        out = []
        for name, init in self.tensors.items():
            module = name.rpartition(".")[0] or "the model"
            whole = [op.name for op in init.ops if op.kind == "whole"]
            if whole:
                out.append(
                    f"{name} ({module}): {whole[0]} is not elementwise, so it is drawn whole on each "
                    "rank that holds part of it"
                )
            elif any(op.kind == "value" for op in init.ops):
                out.append(f"{name} ({module}) was built from computed values: kept whole until split")
            elif not init.ops:
                out.append(f"{name} ({module}) is never initialised when built (torch.empty): it starts at 0")
        return out

    def problems(self) -> list[str]:
        return [f"{name}: {init.problem}" for name, init in self.tensors.items() if init.problem]


_RECORDS: weakref.WeakKeyDictionary[nn.Module, InitRecord] = weakref.WeakKeyDictionary()


def record_of(model: nn.Module) -> InitRecord | None:
    """The initialisation recorded when ``model`` was built (None: built some other way)."""
    return _RECORDS.get(model)


def _scalar(value: Any) -> Any:
    """A Python number for a number or a real one-element tensor; None for anything else."""
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, torch.Tensor) and not value.is_meta and value.numel() == 1:
        return value.item()
    return None


class Recorder(TorchFunctionMode):
    """Records in-place ops on meta tensors while a model is built (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[int, list[Op]] = {}  # storage -> its ops, in order
        self._pinned: list[Any] = []  # the storages recorded, kept alive so their keys stay unique
        self._busy = False

    # -- recording ----------------------------------------------------------------------------------
    def add(self, target: torch.Tensor, op: Op) -> None:
        storage = target.untyped_storage()
        key = storage._cdata
        if key not in self.ops:
            self.ops[key] = []
            self._pinned.append(storage)
        self.ops[key].append(op)

    def value(self, target: torch.Tensor, data: torch.Tensor) -> None:
        """``target`` (meta) starts from ``data`` (real): a constant becomes a fill."""
        region = Region.of(target)
        flat = data.detach().reshape(-1)
        if flat.numel() and bool((flat == flat[0]).all()):
            self.add(target, Op("pointwise", "fill_", (flat[0].item(),), region=region))
        else:
            self.add(target, Op("value", "copy_", region=region, data=data.detach().to(HOST).clone()))

    def _record(self, name: str, target: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kw = tuple(sorted((k, v) for k, v in kwargs.items() if k != "generator"))
        region = Region.of(target)
        scalars = [_scalar(a) for a in args]
        plain = all(s is not None for s in scalars) and all(_scalar(v) is not None for _, v in kw)
        if name in DRAWS and plain:
            self.add(target, Op("draw", name, tuple(scalars), kw, region))
        elif name in POINTWISE and plain:
            self.add(target, Op("pointwise", name, tuple(scalars), kw, region))
        elif name == "copy_" and args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            self.value(target, args[0].expand(target.shape))
        elif name == "__setitem__" and len(args) == 2:
            self._setitem(target, *args)
        else:
            self.add(target, Op("unknown", name, region=region))

    def _setitem(self, target: torch.Tensor, index: Any, value: Any) -> None:
        view = target[index]
        number = _scalar(value)
        if view.untyped_storage()._cdata != target.untyped_storage()._cdata:  # a mask: no region
            self.add(target, Op("unknown", "__setitem__", region=Region.of(target)))
        elif number is not None:
            self.add(target, Op("pointwise", "fill_", (number,), region=Region.of(view)))
        elif isinstance(value, torch.Tensor) and not value.is_meta:
            self.value(view, value.expand(view.shape))
        else:
            self.add(target, Op("unknown", "__setitem__", region=Region.of(view)))

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if self._busy:
            return func(*args, **kwargs)
        if func is torch.empty and kwargs.get("device") is None:
            kwargs["device"] = META  # parameters are made on meta: nothing allocated
        name = getattr(func, "__name__", "")
        target = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
        out = kwargs.get("out")
        self._busy = True
        try:
            if _dispatched(func) and isinstance(target, torch.Tensor) and target.is_meta:
                if 0 not in target.shape and not getattr(target, "_is_hf_initialized", False):
                    self.add(target, _translated(func, args, kwargs))
                return target
            if isinstance(out, torch.Tensor) and out.is_meta:
                self.add(out, Op("unknown", f"{name}(out=)", region=Region.of(out)))
            elif isinstance(target, torch.Tensor) and target.is_meta and _writes(name) and args:
                self._record(name, target, args[1:], kwargs)
        finally:
            self._busy = False
        return func(*args, **kwargs)

    # -- the build ----------------------------------------------------------------------------------
    @contextmanager
    def building(self) -> Iterator[Recorder]:
        with self, _parameters_to_meta(self), _init_functions_wrapped(self):
            yield self

    def finish(self, model: nn.Module) -> InitRecord:
        """The record of ``model``'s meta tensors (see the module docstring); attached to it."""
        record = InitRecord(torch.initial_seed())
        first: dict[int, str] = {}
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        for name, tensor in named:
            owner = first.setdefault(id(tensor), name)
            record.aliases[name] = owner
            if owner == name and tensor.is_meta:
                ops = self.ops.get(tensor.untyped_storage()._cdata, [])
                record.tensors[name] = _tensor_init(tensor, ops)
        _RECORDS[model] = record
        return record


def _dispatched(func: Any) -> bool:
    return getattr(func, "__name__", "") in DISPATCHED and getattr(func, "__module__", "") in INIT_MODULES


def _writes(name: str) -> bool:
    if name == "__setitem__" or name == "copy_":
        return True
    return name.endswith("_") and not name.startswith("_") and name not in NOT_WRITES


def _tensor_init(tensor: torch.Tensor, ops: list[Op]) -> TensorInit:
    """``tensor``'s ops placed as boxes of it, those before its last whole overwrite dropped."""
    shape = tuple(tensor.shape)
    base = int(tensor.storage_offset())
    placed = [_placed(op, base, shape) for op in ops if op.region is not None]
    init = TensorInit(shape, tensor.dtype, _from_last_overwrite(placed, shape))
    init.whole = any(op.kind == "whole" or op.box is None for op in init.ops)
    unknown = [op.name for op in init.ops if op.kind == "unknown"]
    if unknown:
        init.problem = f"{unknown[0]} on it cannot be replayed in parts (it is not elementwise)"
    elif init.ops and not tensor.is_contiguous():
        init.problem = "it is not contiguous, so its recorded regions cannot be placed"
    return init


def _placed(op: Op, base: int, shape: tuple[int, ...]) -> Op:
    """``op`` with its region relative to its tensor and, where it is one, as a box of it (a value's
    only when its dims are in order, so that its data can be laid into the box)."""
    assert op.region is not None
    region = Region(op.region.offset - base, op.region.sizes, op.region.strides)
    box = _box(region, shape, ordered=op.kind == "value")
    data = op.data.reshape(box.lengths) if op.data is not None and box is not None else op.data
    return Op(op.kind, op.name, op.args, op.kwargs, region, box, op.fn, data)


def _from_last_overwrite(ops: list[Op], shape: tuple[int, ...]) -> list[Op]:
    """Ops before the last one that writes every element whatever they held are dead."""
    full = Box.full(shape)
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        overwrites = op.kind in ("draw", "value", "whole") or op.name in ("fill_", "zero_")
        if op.box == full and overwrites:
            return ops[i:]
    return ops


def _box(region: Region, shape: tuple[int, ...], ordered: bool = False) -> Box | None:
    """``region`` (of a contiguous tensor of ``shape``) as a box of it, or None when its elements are
    not one (a diagonal, a stride-2 slice) or, ``ordered``, when its dims are permuted."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    if not 0 <= region.offset < max(math.prod(shape), 1):
        return None
    offsets = list(unravel(region.offset, shape)) if shape else []
    lengths, last = [1] * len(shape), -1
    for size, stride in zip(region.sizes, region.strides, strict=True):
        if size == 1:
            continue
        dims = [d for d in range(len(shape)) if strides[d] == stride and shape[d] > 1 and lengths[d] == 1]
        if not dims or (ordered and dims[0] < last):
            return None
        lengths[dims[0]], last = size, dims[0]
    box = Box(tuple(offsets), tuple(lengths))
    if not box.inside(shape) or box.volume != math.prod(region.sizes):
        return None
    return box


@contextmanager
def _parameters_to_meta(rec: Recorder) -> Iterator[None]:
    """A parameter registered with values goes to meta; its values are its first recorded op."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to(META), requires_grad=param.requires_grad)
            rec.value(meta, param.detach())
            param = meta
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _translated(fn: Callable[..., Any], args: Any, kwargs: Any) -> Op:
    """The op a ``torch.nn.init`` call on a meta tensor stands for (arguments bound by name, the
    bounds computed from the global shape as torch computes them)."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    tensor = bound.arguments["tensor"]
    given = {k: v for k, v in bound.arguments.items() if k not in ("tensor", "generator")}
    region, name = Region.of(tensor), fn.__name__
    if name == "uniform_":
        return Op("draw", "uniform_", (given["a"], given["b"]), region=region)
    if name == "normal_":
        return Op("draw", "normal_", (given["mean"], given["std"]), region=region)
    if name == "constant_":
        return Op("pointwise", "fill_", (given["val"],), region=region)
    if name == "kaiming_uniform_":
        fan = torch.nn.init._calculate_correct_fan(tensor, given["mode"])
        gain = torch.nn.init.calculate_gain(given["nonlinearity"], given["a"])
        limit = math.sqrt(3.0) * gain / math.sqrt(fan)
        return Op("draw", "uniform_", (-limit, limit), region=region)
    kind = "draw" if name in CHUNKED_CALLS else "whole"
    return Op(kind, name, (), tuple(sorted(given.items())), region, fn=fn)


def _wrapped(rec: Recorder, fn: Callable[..., Any]) -> Callable[..., Any]:
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
            return fn(tensor, *args, **kwargs)
        if 0 not in tensor.shape:
            rec.add(tensor, _translated(fn, (tensor, *args), kwargs))
        return tensor

    init.__name__ = fn.__name__
    return init


def load_transformers_init() -> None:
    """Import ``transformers.initialization`` where transformers is installed, so that its copies of
    ``torch.nn.init``'s functions exist to be wrapped (a Hugging Face model, or a factory that may
    build one; about 0.7 s, so the built-in models skip it)."""
    if importlib.util.find_spec("transformers") is not None:
        importlib.import_module("transformers.initialization")


@contextmanager
def _init_functions_wrapped(rec: Recorder) -> Iterator[None]:
    """``torch.nn.init``'s functions a meta tensor would not be seen through (they dispatch to this
    mode as a whole, or skip meta tensors), wrapped wherever a module bound them."""
    originals = {name: getattr(torch.nn.init, name) for name in (*CHUNKED_CALLS, *WHOLE_CALLS)}
    wrappers = {name: _wrapped(rec, fn) for name, fn in originals.items()}
    patched: list[tuple[Any, str, Any]] = []
    holders: list[Any] = [m for n, m in list(sys.modules.items()) if n.startswith("torch.nn.")]
    table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    for name, fn in originals.items():
        for module in holders:
            if getattr(module, name, None) is fn:
                patched.append((module, name, fn))
                setattr(module, name, wrappers[name])
        if isinstance(table, dict) and table.get(name) is fn:
            patched.append((table, name, fn))
            table[name] = wrappers[name]
    try:
        yield
    finally:
        for holder, name, fn in reversed(patched):
            if isinstance(holder, dict):
                holder[name] = fn
            else:
                setattr(holder, name, fn)
