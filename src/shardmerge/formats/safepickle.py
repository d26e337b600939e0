"""The one restricted unpickler for every pickle shardmerge reads.

Rank files, Lightning ``.ckpt`` files, DCP ``.metadata`` and Megatron ``common.pt`` are pickles, and a pickle can run
arbitrary code. This unpickler resolves only:

* an allow-list of tensor, storage, DTensor/device-mesh/placement and DCP-metadata types of torch, plus a few inert
  builtins and numpy array reconstruction (what ``torch.save`` of state dicts and RNG states produces);
* *inert stand-ins* for harmless foreign classes that trainers put next to the weights (OmegaConf containers,
  ``megatron.*`` enums and configs, Lightning attribute dicts, ``typing`` markers): an instance records what it was
  built from and can do nothing else;

and refuses anything else with a :class:`PickleRefusedError` naming the global and the file. ``trust=True``
(``--trust-pickle``) is the explicit last resort and resolves globals normally.
"""

from __future__ import annotations

import _compat_pickle
import importlib
import io
import pickle
from typing import Any, Callable

from ..errors import PickleRefusedError

# (module, name) pairs resolved to the real object.
_ALLOWED: set[tuple[str, str]] = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("builtins", "bytearray"),
    ("builtins", "object"),
    ("builtins", "dict"),
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("builtins", "int"),
    ("builtins", "float"),
    ("builtins", "str"),
    ("builtins", "bool"),
    ("builtins", "range"),
    ("copyreg", "_reconstructor"),
    ("_codecs", "encode"),
    ("argparse", "Namespace"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("datetime", "datetime"),
    ("datetime", "date"),
    ("datetime", "timedelta"),
    ("datetime", "timezone"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "Tensor"),
    ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._utils", "_rebuild_wrapper_subclass"),
    ("torch._utils", "_rebuild_device_tensor_from_numpy"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._api", "DTensor"),
    ("torch.distributed._tensor.api", "DTensor"),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    ("torch.distributed._mesh_layout", "_MeshLayout"),
    ("torch.distributed._mesh_layout", "_FlatLayout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # Planner dataclasses: megatron-core keeps the cached save plans in .metadata's planner data.
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.distributed.checkpoint.planner", "ReadItem"),
    ("torch.distributed.checkpoint.planner", "LoadPlan"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}

# Whole modules whose public classes are plain data (dataclasses / enums) and are resolved to the real object.
_ALLOWED_MODULES = (
    "torch.distributed.tensor.placement_types",
    "torch.distributed._tensor.placement_types",
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint._extension",
    "numpy.dtypes",
)

# Foreign modules whose objects are replaced by inert stand-ins.
_STANDIN_PREFIXES = (
    "omegaconf",
    "megatron",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "typing",
    "enum",
    "transformer_engine",
    "verl",
)


class Inert:
    """Stand-in for a harmless foreign object: it keeps the arguments and state it was built from, nothing else.

    ``standin_args``, ``standin_kwargs``, ``standin_state`` and ``standin_items`` hold what the pickle provided;
    attribute access on dict states works (``obj.hidden_size``) so metadata can be inspected.
    """

    standin_global = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Inert":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["standin_args"] = args
        self.__dict__["standin_kwargs"] = kwargs
        self.__dict__["standin_items"] = {}
        self.__dict__["standin_list"] = []

    def __setstate__(self, state: Any) -> None:
        self.__dict__.setdefault("standin_items", {})
        self.__dict__.setdefault("standin_list", [])
        self.__dict__.setdefault("standin_args", ())
        self.__dict__["standin_state"] = state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]} if isinstance(state[0], dict) else state[1]
        if isinstance(state, dict):
            for k, v in state.items():
                if isinstance(k, str) and not k.startswith("standin_"):
                    self.__dict__[k] = v

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("standin_items", {})[key] = value

    def __getitem__(self, key: Any) -> Any:
        return self.__dict__.get("standin_items", {})[key]

    def append(self, value: Any) -> None:
        self.__dict__.setdefault("standin_list", []).append(value)

    def extend(self, values: Any) -> None:
        self.__dict__.setdefault("standin_list", []).extend(values)

    def __repr__(self) -> str:
        return f"<stand-in {self.standin_global}>"


_standins: dict[tuple[str, str], type] = {}


def _standin(module: str, name: str) -> type:
    key = (module, name)
    cls = _standins.get(key)
    if cls is None:
        cls = type(name, (Inert,), {"standin_global": f"{module}.{name}", "__module__": "shardmerge.standin"})
        _standins[key] = cls
    return cls


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    if module == "torch" and (name.endswith("Storage") or _is_torch_dtype(name)):
        return True
    return module in _ALLOWED_MODULES and not name.startswith("__")


def _is_torch_dtype(name: str) -> bool:
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def is_standin(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in _STANDIN_PREFIXES)


def make_unpickler(
    file: Any,
    path: str,
    trust: bool = False,
    persistent_load: Callable[[Any], Any] | None = None,
    overrides: dict[tuple[str, str], Any] | None = None,
) -> pickle.Unpickler:
    """An unpickler over ``file`` (binary file object) that applies the allow-list.

    Args:
        path: the file's path, named in refusals.
        trust: resolve every global normally (``--trust-pickle``).
        persistent_load: handler for persistent ids (torch storages).
        overrides: ``(module, name) -> object`` resolved before the allow-list (used to intercept tensor rebuilds).
    """
    overrides = overrides or {}

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # Protocol-2 pickles name Python 2 modules (__builtin__, copy_reg); map them as pickle itself does.
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
            hit = overrides.get((module, name))
            if hit is not None:
                return hit
            if trust or _allowed(module, name):
                return _resolve(module, name)
            if is_standin(module):
                return _standin(module, name)
            raise PickleRefusedError(
                f"refusing to unpickle global '{module}.{name}' in {path}: not a tensor, sharding or known metadata "
                "type; if you trust this file, pass --trust-pickle"
            )

    unpickler = _Unpickler(file, encoding="utf-8")
    if persistent_load is not None:
        unpickler.persistent_load = persistent_load
    return unpickler


def _resolve(module: str, name: str) -> Any:
    mod = importlib.import_module(module)
    obj = mod
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def loads(data: bytes, path: str, trust: bool = False, **kw: Any) -> Any:
    """Unpickle ``data`` (read from ``path``) through the allow-list.

    Raises:
        PickleRefusedError: a global outside the allow-list (names the global and ``path``).
        SourceError: the bytes are not a valid pickle.
    """
    from ..errors import SourceError

    try:
        return make_unpickler(io.BytesIO(data), path, trust=trust, **kw).load()
    except PickleRefusedError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as e:
        raise SourceError(f"{path}: cannot unpickle ({type(e).__name__}: {e}); the file is corrupt or truncated") from None
