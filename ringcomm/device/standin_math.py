"""The arithmetic of the host stand-in device array, done by NumPy on the wrapped arrays.

:class:`ArrayMath` (mixed into :class:`~ringcomm.device.standin.StandinArray`) and
:class:`ModuleMath` (into its ``xp``) give the part of CuPy's surface the training engine
computes with (elementwise math, matmul, reductions, indexing, creation), so code written
once over ``xp`` runs on the stand-in exactly as on CuPy.

Invariants, as CuPy's: a stand-in array never becomes a NumPy array implicitly
(``np.asarray(a)``, NumPy functions and ufuncs raise ``TypeError``); a NumPy operand mixed
in raises ``TypeError``; results are stand-in arrays (reductions 0-d ones). The only ways
between host and device are explicit: ``xp.asarray(host)``, and ``get()``, ``item()``,
``float``/``int``/``bool`` of one element. Details: docs/architecture.md, section
"device/standin_math.py".
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ArrayMath", "ModuleMath", "host_operand"]


def host_operand(value: Any, what: str) -> Any:
    """``value`` as NumPy sees it: a stand-in array's host array (lists and tuples of them
    too); a NumPy array is refused (``TypeError``: a host array mixed with device ones)."""
    if isinstance(value, ArrayMath):
        return value.host
    if isinstance(value, np.ndarray):
        raise TypeError(
            f"{what}: a numpy.ndarray mixed with stand-in device arrays (copy it to the "
            "device with xp.asarray first, as CuPy requires)"
        )
    if isinstance(value, (list, tuple)):
        return type(value)(host_operand(v, what) for v in value)
    return value  # Python and NumPy scalars, dtypes, slices, None, Ellipsis


def _binary(name: str, fn: Callable[[Any, Any], Any], reflected: bool = False) -> Any:
    def method(self: ArrayMath, other: Any) -> Any:
        b = host_operand(other, f"stand-in {name}")
        return self._wrap(fn(b, self.host) if reflected else fn(self.host, b))

    method.__name__ = name
    return method


def _inplace(name: str, fn: Callable[[Any, Any], Any]) -> Any:
    def method(self: ArrayMath, other: Any) -> Any:
        fn(self.host, host_operand(other, f"stand-in {name}"))  # in place on the host array
        return self

    method.__name__ = name
    return method


def _numeric(
    name: str, fn: Callable[[Any, Any], Any], in_place: Callable[[Any, Any], Any]
) -> tuple[Any, Any, Any]:
    """``__name__``, ``__rname__`` and ``__iname__`` of the arithmetic operator ``fn``."""
    return (
        _binary(f"__{name}__", fn),
        _binary(f"__r{name}__", fn, reflected=True),
        _inplace(f"__i{name}__", in_place),
    )


def _unary(name: str, fn: Callable[[Any], Any]) -> Any:
    def method(self: ArrayMath) -> Any:
        return self._wrap(fn(self.host))

    method.__name__ = name
    return method


def _reduction(name: str) -> Any:
    def method(self: ArrayMath, *args: Any, **kwargs: Any) -> Any:
        what = f"stand-in {name}"
        host = getattr(self.host, name)(*host_operand(args, what), **_kw(kwargs, what))
        return self._wrap(host)

    method.__name__ = name
    return method


def _kw(kwargs: dict[str, Any], what: str) -> dict[str, Any]:
    return {k: host_operand(v, what) for k, v in kwargs.items()}


class ArrayMath:
    """Operators and methods of a stand-in array (``self.host``: the NumPy array)."""

    __slots__ = ()
    host: np.ndarray

    def _wrap(self, value: Any) -> Any:
        """A NumPy result as a stand-in array (a NumPy scalar as a 0-d one, as CuPy)."""
        make: Any = type(self)  # (the array class: its constructor takes the host array)
        if isinstance(value, np.ndarray):
            return make(value)
        if isinstance(value, np.generic):
            return make(np.asarray(value))
        if isinstance(value, tuple):
            return tuple(self._wrap(v) for v in value)
        return value

    # -- never a NumPy array by accident ---------------------------------------------
    __array_ufunc__ = None  # NumPy ufuncs on a stand-in array raise TypeError

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            "Implicit conversion of a stand-in device array to a NumPy array is not "
            "allowed (as with CuPy): use .get()"
        )

    def __array_function__(self, *args: Any, **kwargs: Any) -> Any:
        return NotImplemented  # NumPy functions refuse it (TypeError), as CuPy's arrays

    __hash__ = None  # type: ignore[assignment]  # (== is elementwise)

    # -- device to host: explicit, synchronising, one element -------------------------
    def item(self) -> Any:
        return self.host.item()

    def __float__(self) -> float:
        return float(self.host.item())

    def __int__(self) -> int:
        return int(self.host.item())

    def __bool__(self) -> bool:
        return bool(self.host.item()) if self.host.size == 1 else bool(self.host)

    # -- shape and layout ---------------------------------------------------------------
    @property
    def T(self) -> Any:
        return self._wrap(self.host.T)

    @property
    def strides(self) -> tuple[int, ...]:
        return self.host.strides

    def transpose(self, *axes: Any) -> Any:
        return self._wrap(self.host.transpose(*axes))

    def swapaxes(self, a: int, b: int) -> Any:
        return self._wrap(self.host.swapaxes(a, b))

    def ravel(self) -> Any:
        return self._wrap(self.host.ravel())

    def astype(self, dtype: Any, copy: bool = True) -> Any:
        return self._wrap(self.host.astype(dtype, copy=copy))

    def fill(self, value: Any) -> None:
        self.host.fill(host_operand(value, "stand-in fill"))

    def __setitem__(self, index: Any, value: Any) -> None:
        what = "stand-in __setitem__"
        self.host[host_operand(index, what)] = host_operand(value, what)

    def __iter__(self) -> Any:
        return (self._wrap(row) for row in self.host)

    # -- reductions (0-d arrays, not scalars) ------------------------------------------
    sum = _reduction("sum")
    mean = _reduction("mean")
    max = _reduction("max")
    min = _reduction("min")
    argmax = _reduction("argmax")
    argmin = _reduction("argmin")
    all = _reduction("all")
    any = _reduction("any")

    # -- arithmetic ----------------------------------------------------------------------
    # (as NumPy's NDArrayOperatorsMixin: an operator's forward, reflected, in-place forms)
    __add__, __radd__, __iadd__ = _numeric("add", operator.add, operator.iadd)
    __sub__, __rsub__, __isub__ = _numeric("sub", operator.sub, operator.isub)
    __mul__, __rmul__, __imul__ = _numeric("mul", operator.mul, operator.imul)
    __truediv__, __rtruediv__, __itruediv__ = _numeric(
        "truediv", operator.truediv, operator.itruediv
    )
    __pow__, __rpow__, __ipow__ = _numeric("pow", operator.pow, operator.ipow)
    __and__, __rand__, __iand__ = _numeric("and", operator.and_, operator.iand)
    __or__, __ror__, __ior__ = _numeric("or", operator.or_, operator.ior)
    __matmul__ = _binary("__matmul__", operator.matmul)
    __rmatmul__ = _binary("__rmatmul__", operator.matmul, reflected=True)
    __floordiv__ = _binary("__floordiv__", operator.floordiv)
    __mod__ = _binary("__mod__", operator.mod)
    __xor__ = _binary("__xor__", operator.xor)
    __lt__ = _binary("__lt__", operator.lt)
    __le__ = _binary("__le__", operator.le)
    __gt__ = _binary("__gt__", operator.gt)
    __ge__ = _binary("__ge__", operator.ge)
    __eq__ = _binary("__eq__", operator.eq)
    __ne__ = _binary("__ne__", operator.ne)
    __neg__ = _unary("__neg__", operator.neg)
    __pos__ = _unary("__pos__", operator.pos)
    __abs__ = _unary("__abs__", operator.abs)
    __invert__ = _unary("__invert__", operator.invert)


#: NumPy functions the stand-in module offers over stand-in arrays (CuPy has each).
_FUNCTIONS = frozenset(
    [
        "abs",
        "all",
        "any",
        "arange",
        "argmax",
        "broadcast_to",
        "clip",
        "concatenate",
        "cos",
        "cumsum",
        "exp",
        "expand_dims",
        "eye",
        "full",
        "full_like",
        "isfinite",
        "isnan",
        "linspace",
        "log",
        "matmul",
        "max",
        "maximum",
        "mean",
        "min",
        "minimum",
        "ones",
        "ones_like",
        "sin",
        "sqrt",
        "square",
        "stack",
        "sum",
        "swapaxes",
        "tanh",
        "transpose",
        "tril",
        "triu",
        "where",
    ]
)
#: Names NumPy and CuPy share that are not functions of arrays (dtypes, constants).
_CONSTANTS = frozenset(
    [
        "bool_",
        "complex64",
        "complex128",
        "dtype",
        "e",
        "finfo",
        "float16",
        "float32",
        "float64",
        "iinfo",
        "inf",
        "int8",
        "int16",
        "int32",
        "int64",
        "nan",
        "newaxis",
        "pi",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    ]
)


class ModuleMath:
    """The stand-in module's computing functions: NumPy's, over stand-in arrays only
    (``_array_type`` wraps the results). Unknown names raise ``AttributeError``."""

    _array_type: Any

    def __getattr__(self, name: str) -> Any:
        if name in _CONSTANTS:
            return getattr(np, name)
        if name not in _FUNCTIONS or not hasattr(np, name):
            raise AttributeError(f"the stand-in device module has no {name!r}")
        fn = getattr(np, name)
        wrap = self._array_type

        def call(*args: Any, **kwargs: Any) -> Any:
            what = f"stand-in {name}"
            out = fn(*host_operand(args, what), **_kw(kwargs, what))
            if isinstance(out, np.ndarray):
                return wrap(out)
            if isinstance(out, np.generic):
                return wrap(np.asarray(out))
            return out

        call.__name__ = name
        return call

    def ascontiguousarray(self, a: Any, dtype: Any = None) -> Any:
        host = host_operand(a, "stand-in ascontiguousarray")
        return self._array_type(np.ascontiguousarray(host, dtype))
