"""Atomic loads/stores on shared int64 flag words, and spin waits built on them.

A plain `while flag[i] != v` in numba can be hoisted by LLVM into an infinite
loop, so every flag access goes through an acquire load or a release store.
Everything here is @njit(cache=True) and safe to call from the main process
or from a worker.
"""
import os
import platform

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


def _is_flags(arrty):
    """The atomics take 1-d int64 arrays (flag words)."""
    return isinstance(arrty, types.Array) and arrty.dtype == types.int64 and arrty.ndim == 1


def _item_ptr(context, builder, arrty, arr, idx):
    ary = context.make_array(arrty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [idx])


def _load(ordering):
    """codegen of an atomic load of arr[idx] with `ordering`."""
    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, ordering, 8)
    return codegen


def _rmw(op, ordering):
    """codegen of an atomic read-modify-write `op` of arr[idx] with `ordering`; returns the old value."""
    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig.args[0], args[0], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw(op, ptr, v, ordering)
    return codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx] with acquire ordering (arr: 1-d int64 array)."""
    if not _is_flags(arr):
        return None
    return types.int64(arr, idx), _load("acquire")


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """arr[idx] = val with release ordering (arr: 1-d int64 array)."""
    if not _is_flags(arr):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig.args[0], args[0], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, ptr, "release", 8)
        return context.get_dummy_value()

    return types.void(arr, idx, val), codegen


@intrinsic
def fetch_add(typingctx, arr, idx, val):
    """Atomically arr[idx] += val; returns the old value (acq_rel; arr: 1-d int64 array)."""
    if not _is_flags(arr):
        return None
    return types.int64(arr, idx, val), _rmw("add", "acq_rel")


@intrinsic
def compare_exchange(typingctx, arr, idx, expected, new):
    """If arr[idx] == expected, set it to new; returns whether it did (acq_rel; 1-d int64 array)."""
    if not _is_flags(arr):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig.args[0], args[0], args[1])
        exp = context.cast(builder, args[2], sig.args[2], types.int64)
        new = context.cast(builder, args[3], sig.args[3], types.int64)
        pair = builder.cmpxchg(ptr, exp, new, "acq_rel", "acquire")
        return builder.extract_value(pair, 1)

    return types.boolean(arr, idx, expected, new), codegen


@intrinsic
def exchange(typingctx, arr, idx, val):
    """Atomically arr[idx] = val, returning the old value, as a full fence (seq_cst): what one
    side of a sleep/wake handshake needs (the store is visible before any later load)."""
    if not _is_flags(arr):
        return None
    return types.int64(arr, idx, val), _rmw("xchg", "seq_cst")


@intrinsic
def load_seq_cst(typingctx, arr, idx):
    """arr[idx] with seq_cst ordering: the other side of exchange()'s handshake."""
    if not _is_flags(arr):
        return None
    return types.int64(arr, idx), _load("seq_cst")


@intrinsic
def cpu_relax(typingctx):
    """x86 `pause` (a no-op elsewhere): keeps a spinning core polite to its sibling."""

    def codegen(context, builder, sig, args):
        if "x86" in context.codegen()._tm.triple:
            fnty = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True)
def store(flags, idx, value):
    atomic_store(flags, idx, value)


@njit(cache=True)
def swap(flags, idx, value):
    """flags[idx] = value as a full fence (exchange); returns the old value."""
    return exchange(flags, idx, value)


@njit(cache=True)
def load(flags, idx):
    return atomic_load(flags, idx)


@njit(cache=True)
def post(flags, first, count, stride, value):
    """Release-store value into flags[first + k*stride] for k < count."""
    for k in range(count):
        atomic_store(flags, first + k * stride, value)


@njit(cache=True)
def spin_until_changed(flags, idx, old, budget):
    """Spin until flags[idx] != old; return the new value, or `old` after `budget` polls."""
    for _ in range(budget):
        v = atomic_load(flags, idx)
        if v != old:
            return v
        cpu_relax()
    return old


@njit(cache=True)
def spin_until_all(flags, first, count, stride, value, budget):
    """Spin until flags[first + k*stride] == value for every k < count; return True if so
    within `budget` polls, False otherwise."""
    k = 0
    for _ in range(budget):
        while k < count and atomic_load(flags, first + k * stride) == value:
            k += 1
        if k == count:
            return True
        cpu_relax()
    return False


# Sleeping on a flag word: Linux futex on the word's low 32 bits (little-endian: the bits that
# change from one job to the next). Not FUTEX_PRIVATE: the word lives in shared memory that the
# waker maps at another address.
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine(), -1)
FUTEX_WAIT, FUTEX_WAKE = 0, 1
HAVE_FUTEX = SYS_FUTEX > 0 and os.uname().sysname == "Linux"


@intrinsic
def futex(typingctx, arr, idx, op, val, timeout):
    """syscall(SYS_futex, &arr[idx], op, val, timeout) -> long (timeout: address of a timespec,
    or 0). Calls libc's variadic syscall() by name, so a cached compilation relinks it in each
    process (a ctypes pointer would bake one process's address in)."""
    if not _is_flags(arr):
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(i64, [i64], var_arg=True)
        fn = cgutils.get_or_insert_function(builder.module, fnty, "syscall")
        ptr = _item_ptr(context, builder, sig.args[0], args[0], args[1])
        addr = builder.ptrtoint(ptr, i64)
        op_, val_, tmo = (context.cast(builder, args[k], sig.args[k], types.int64) for k in (2, 3, 4))
        return builder.call(fn, [i64(SYS_FUTEX), addr, op_, val_, tmo, i64(0), i64(0)])

    return types.int64(arr, idx, op, val, timeout), codegen


@njit(cache=True)
def sleep_until_changed(flags, idx, old, asleep, timeout_ns):
    """Block (futex) until flags[idx] != old, at most timeout_ns; returns flags[idx] (== old on a
    timeout or a spurious wake). asleep is this waiter's sleep word: set while it may sleep, so
    a waker (post_and_wake) makes the syscall only when someone may be asleep. The handshake:
    the waiter sets asleep (full fence) then re-checks the flag; the waker stores the flag (full
    fence) then reads asleep: one of the two sees the other's store."""
    exchange(flags, asleep, 1)
    v = atomic_load(flags, idx)
    if v == old:
        ts = np.empty(2, np.int64)                  # struct timespec {tv_sec, tv_nsec}
        ts[0], ts[1] = timeout_ns // 1000000000, timeout_ns % 1000000000
        futex(flags, idx, FUTEX_WAIT, old & 0xFFFFFFFF, ts.ctypes.data)  # at once if the low half changed
        v = atomic_load(flags, idx)
    atomic_store(flags, asleep, 0)
    return v


@njit(cache=True)
def wake_sleepers(flags, first, count, stride, asleep_offset):
    """Wake each waiter on flags[first + k*stride] whose sleep word (that index + asleep_offset)
    says it may sleep (sleep_until_changed)."""
    for k in range(count):
        i = first + k * stride
        if load_seq_cst(flags, i + asleep_offset) != 0:
            futex(flags, i, FUTEX_WAKE, 1, 0)


@njit(cache=True)
def post_and_wake(flags, first, count, stride, value, asleep_offset):
    """post() with full fences, then wake_sleepers(): a waiter either sees the new value when it
    re-checks, or is asleep and woken."""
    for k in range(count):
        exchange(flags, first + k * stride, value)
    wake_sleepers(flags, first, count, stride, asleep_offset)


@njit(cache=True)
def claim(flags, idx, tag):
    """Take one unit from a tagged countdown ticket flags[idx] = tag << 32 | units left.
    Returns the units left before this claim (>= 1), or 0 when the ticket is empty or carries
    another tag (a later job's: a worker that woke late must not take its units)."""
    while True:
        t = atomic_load(flags, idx)
        left = t & 0xFFFFFFFF
        if t >> 32 != tag or left == 0:
            return 0
        if compare_exchange(flags, idx, t, t - 1):
            return left


def warm_up():
    """Compile (or load from the on-disk cache) every function of this module once."""
    import numpy as np

    a = np.zeros(16, np.int64)
    store(a, 0, 1)
    load(a, 0)
    swap(a, 0, 0)
    post(a, 0, 2, 8, 0)
    spin_until_changed(a, 0, 1, 1)
    spin_until_all(a, 0, 2, 8, 1, 1)
    claim(a, 0, 1)
    if HAVE_FUTEX:
        post_and_wake(a, 0, 1, 8, 0, 1)
        wake_sleepers(a, 0, 1, 8, 1)
        sleep_until_changed(a, 0, 1, 1, 0)


__all__ = ["atomic_load", "atomic_store", "fetch_add", "compare_exchange", "claim", "cpu_relax", "exchange", "load_seq_cst",
           "sleep_until_changed", "post_and_wake", "wake_sleepers", "HAVE_FUTEX", "store", "load", "swap", "post",
           "spin_until_changed", "spin_until_all", "warm_up", "numba"]
