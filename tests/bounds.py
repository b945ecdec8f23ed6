"""Out-of-bounds loads and stores of the Triton kernels, caught in the interpreter.

A kernel that reads past a tensor on a GPU reads another allocation's bytes, or faults; in the
interpreter it reads whatever is there, silently, and where the value only feeds outputs that are
never stored (a ragged tile's extra rows), no test of values can see it. Inside `in_bounds()`, every
live address of every load and store must fall inside one of the launch's tensor arguments, from its
first element to its last; one that does not raises AssertionError naming the kernel.

It wraps two methods of Triton's interpreter (GridExecutor._init_args_hst, which takes a launch's
arguments to the host, and InterpreterBuilder.create_masked_load / _store, which every load and store
goes through): private, so `in_bounds()` fails at once, with AttributeError, on a Triton whose
interpreter has changed, rather than passing without checking. On a GPU it checks nothing (there,
`compute-sanitizer --tool memcheck` does)."""
import contextlib

import numpy as np
import pytest

from conftest import HAS_CUDA


def _extent(t):  # a tensor argument -> (first byte, one past its last element's last byte), or None if empty
    t = getattr(t, "base", t) if type(t).__name__ == "TensorWrapper" else t          # a uint8 view of fp8
    if t.numel() == 0:
        return None
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@contextlib.contextmanager
def in_bounds():
    import triton.runtime.interpreter as interp
    Grid, Builder = interp.GridExecutor, interp.InterpreterBuilder
    init, load, store = Grid._init_args_hst, Builder.create_masked_load, Builder.create_masked_store
    extents, kernel = [], [None]

    def init_args(self, args_dev, kwargs):                      # each launch: its arguments' extents
        args, kw = init(self, args_dev, kwargs)
        extents[:] = [e for x in [*args, *kw.values()] if hasattr(x, "data_ptr") and (e := _extent(x))]
        kernel[0] = getattr(getattr(self, "fn", None), "__name__", "a kernel")
        return args, kw

    def check(ptrs, mask, what):
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        at = ptrs.data.astype(np.uint64)
        live = at[np.broadcast_to(mask.data, at.shape)] if mask is not None else at.ravel()
        inside = np.zeros(live.shape, bool)
        for lo, hi in extents:
            inside |= (live >= lo) & (live + size <= hi)
        if not inside.all():
            raise AssertionError(f"{kernel[0]}: {int((~inside).sum())} {what} addresses outside its tensor arguments")

    def checked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def checked_store(self, ptrs, value, mask, cache_policy):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, cache_policy)

    Grid._init_args_hst, Builder.create_masked_load, Builder.create_masked_store = init_args, checked_load, checked_store
    try:
        yield
    finally:
        Grid._init_args_hst, Builder.create_masked_load, Builder.create_masked_store = init, load, store


@pytest.fixture(autouse=True)
def loads_and_stores_in_bounds():  # imported by a test module: each of its tests inside in_bounds() (interpreter)
    if HAS_CUDA:
        yield
        return
    with in_bounds():
        yield
