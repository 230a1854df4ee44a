"""Register-tiled micro-kernels for decode attention, written as LLVM vector IR.

numba's loop vectorizer cannot keep a tile of accumulators in registers across
an outer loop (it reloads and stores them, because it cannot prove the scratch
arrays do not alias the cache), so the two inner products of attention are
emitted here directly as <16 x float> operations. LLVM legalizes the vectors
for the host (one zmm on AVX-512, two ymm on AVX2, four q-registers on NEON).

KV storage is widened in registers: fp32 loads as is, bf16 is (bits << 16),
fp16 goes through `fpext half` (vcvtph2ps on x86 with F16C).

  QK[nr](qs, qp, r0, kt, blk, nxt, S, c0, code, dp)
      S[r0+i, c0:c0+BK] = sum_d qs[r0+i, d] * kt[blk, d, :BK]          i < nr
      (and block nxt, the one read next, is prefetched: see _prefetch_ahead)
      qs [R, D] f32 (queries), kt [nblk, D, BK] storage (K blocks, transposed so a
      block's BK scores are two vectors), S [R, >= c0+BK] f32.
      bf16 K blocks are pair-interleaved: element (d, j) of a block sits at
      (d // 2) * 2*BK + 2*j + d % 2, i.e. the block is [D/2, BK, 2], so one
      32-bit lane holds dims (2p, 2p+1) of token j. Widening is then a shift and
      a mask, and with dp > 0 on a CPU with AVX512-BF16 one vdpbf16ps does two
      dims at once from qp [R, D/2] u32 (q as packed bf16 pairs, which must be
      exact: bf16 models give bf16 q), halving the QK arithmetic; the scores are
      then multiplied by dp (the softmax scale) as they are stored.
  PV[nr](P, r0, c0, vt, blk, nxt, n, o, code)
      o[r0+i, c*W:(c+1)*W] += sum_{jj<n} P[r0+i, c0+jj] * vt[blk, c, jj, :]   i < nr
      P [R, >= c0+BK] f32 (probabilities), vt [nblk, D/W, BK, W] storage (V blocks cut
      into W-wide column panels, so each pass over a panel reads contiguous
      memory), o [R, D] f32.

  ROWMAX(S, r, w, init)
      max(init, S[r, :w]) for S [R, >= w] f32 and w a multiple of W (numba's own loop
      cannot vectorize a max reduction without the nnan flag, which the kernel does not
      set: it would let LLVM assume no NaN anywhere in the softmax).

  EXP_ROW(S, r, w, bm)
      S[r, :w] = exp(S[r, :w] - bm) (0 below -87, so masked -inf scores give 0), returns
      their sum, 16 lanes at a time (numba's own loop of the same formula ran 8 wide at
      2.3x the time here). EXP_NEG(x) is the same exp of one float32 (see _exp).

Storage is a float32 array, or a uint16 array of bf16 (code 1) / fp16 (code 2)
bits; the uint16 variants branch on `code` once per call, outside the loops.
D must be a multiple of W = 16. All arrays must be C-contiguous. nr is 1, 2 or 4
query rows per call: a register tile of 2*nr (QK) or nr (PV) accumulators.
"""
import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

W = 16          # lanes per vector
BK = 2 * W      # KV rows per block (two score vectors per query row)
PREFETCH = True  # the K and V loops prefetch the block read next (_prefetch_ahead)

_F32 = ir.FloatType()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VF = ir.VectorType(_F32, W)
_VI = ir.VectorType(_I32, W)


class _BFloat(ir.Type):
    """LLVM's bfloat (llvmlite has no class for it)."""
    def _to_string(self):
        return "bfloat"


_VBF = ir.VectorType(_BFloat(), 2 * W)


def _host_has_dpbf16():
    from numba.core import config
    import llvmlite.binding as ll
    feats = config.CPU_FEATURES if config.CPU_FEATURES is not None else ll.get_host_cpu_features().flatten()
    return "+avx512bf16" in feats.split(",")


HAS_DPBF16 = _host_has_dpbf16()    # vdpbf16ps is emitted only when the compile target has it


def _data(context, builder, arrty, arr):
    ary = context.make_array(arrty)(context, builder, arr)
    return ary.data, cgutils.unpack_tuple(builder, ary.shape)


def _splat(builder, x):
    v = builder.insert_element(ir.Constant(_VF, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_VF, ir.Undefined), ir.Constant(ir.VectorType(_I32, W), [0] * W))


def _vf(x):
    """A <W x float> constant."""
    return ir.Constant(_VF, [float(x)] * W)


def _fmuladd(builder, a, b, c):
    fnty = ir.FunctionType(_VF, [_VF, _VF, _VF])
    fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fmuladd.v{W}f32")
    return builder.call(fn, [a, b, c])


def _dpbf16(builder, acc, a, b):
    """acc + a[2i]*b[2i] + a[2i+1]*b[2i+1] per lane; a, b <W x i32> holding bf16 pairs."""
    fnty = ir.FunctionType(_VF, [_VF, _VBF, _VBF])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512bf16.dpbf16ps.512")
    return builder.call(fn, [acc, builder.bitcast(a, _VBF), builder.bitcast(b, _VBF)])


def _prefetch(builder, base, offset):
    """Hint the cache line holding base[offset] toward L1 (prefetcht0; never faults, so it may
    point past the array: a unit's last block prefetches the next unit's first, or nothing)."""
    i8p = ir.IntType(8).as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(builder.gep(base, [offset]), i8p), ir.Constant(_I32, 0),    # read,
                      ir.Constant(_I32, 3), ir.Constant(_I32, 1)])                              # keep, data


def _block_step(builder, blkv, nxtv, D):
    """Elements from block blk to block nxt (a block is D*BK elements, K's [D, BK] and V's
    [D/W, BK, W] alike): the distance _prefetch_ahead looks ahead by."""
    return builder.mul(builder.sub(nxtv, blkv), builder.mul(D, ir.Constant(_I64, BK)))


def _prefetch_ahead(builder, base, offset, step, conv, elems):
    """Prefetch what block nxt holds where block blk is being read (offset; step = _block_step):
    the caller's next block, which a block table may put anywhere (blk + 1 in a contiguous
    cache). The loops read a block front to back, so the next one arrives a block ahead of its
    use: on the H100 host's Xeon a core read its blocks at 6.4 GB/s, far below its share of the
    socket's bandwidth, as a core waiting on each line would (its hardware prefetchers stop at
    every 4 KB page, and cannot follow a table). elems: the storage elements the loop reads from
    offset on."""
    if not PREFETCH:
        return
    ahead = builder.add(offset, step)
    per_line = 64 // (4 if conv == "f32" else 2)                  # storage elements per cache line
    for i in range(-(-elems // per_line)):
        _prefetch(builder, base, builder.add(ahead, ir.Constant(_I64, i * per_line)))


def _load_ivec(builder, base, offset):
    """W 32-bit lanes (2W uint16 storage elements) at base[offset]."""
    return builder.load(builder.bitcast(builder.gep(base, [offset]), _VI.as_pointer()), align=4)


def _load_vec(builder, base, offset, conv):
    """W storage elements at base[offset], widened to <W x float>."""
    ptr = builder.gep(base, [offset])
    if conv == "f32":
        return builder.load(builder.bitcast(ptr, _VF.as_pointer()), align=4)
    raw = builder.load(builder.bitcast(ptr, ir.VectorType(_I16, W).as_pointer()), align=2)
    if conv == "bf16":
        wide = builder.zext(raw, ir.VectorType(_I32, W))
        wide = builder.shl(wide, ir.Constant(ir.VectorType(_I32, W), [16] * W))
        return builder.bitcast(wide, _VF)
    return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), W)), _VF)


def _storage_ok(arr, ndim):
    return (isinstance(arr, types.Array) and arr.ndim == ndim and arr.layout == "C"
            and arr.dtype in (types.float32, types.uint16))


def _by_storage(context, builder, arrty, code, codety, emit):
    """emit(conv) once for fp32 storage; for uint16 storage, a runtime branch on code."""
    if arrty.dtype == types.float32:
        emit("f32")
        return
    c = context.cast(builder, code, codety, types.int64)
    with builder.if_else(builder.icmp_signed("==", c, ir.Constant(_I64, 2))) as (is_f16, is_bf16):
        with is_f16:
            emit("f16")
        with is_bf16:
            emit("bf16")


def _f32_ok(arr):
    return isinstance(arr, types.Array) and arr.ndim == 2 and arr.layout == "C" and arr.dtype == types.float32


def _make_qk(nr):
    @intrinsic
    def qk(typingctx, qs, qp, r0, kt, blk, nxt, S, c0, code, dp):
        if not (_f32_ok(qs) and _f32_ok(S) and _storage_ok(kt, 3)
                and isinstance(qp, types.Array) and qp.ndim == 2 and qp.layout == "C" and qp.dtype == types.uint32
                and all(isinstance(x, types.Integer) for x in (r0, blk, nxt, c0, code)) and dp == types.float32):
            return None

        def codegen(context, builder, sig, args):
            qptr, (_, D) = _data(context, builder, sig.args[0], args[0])
            qpptr, _ = _data(context, builder, sig.args[1], args[1])
            kptr, _ = _data(context, builder, sig.args[3], args[3])
            sptr, (_, sstride) = _data(context, builder, sig.args[6], args[6])
            r0v, blkv, nxtv, c0v = (context.cast(builder, args[k], sig.args[k], types.int64) for k in (2, 4, 5, 7))
            dpv = args[9]
            kbase = builder.mul(blkv, builder.mul(D, ir.Constant(_I64, BK)))   # start of block blk
            step = _block_step(builder, blkv, nxtv, D)
            accs = [cgutils.alloca_once(builder, _VF) for _ in range(2 * nr)]
            pairs = functools.partial(_qk_pairs, builder, nr, D, qptr, qpptr, r0v, kptr, kbase, step, accs)

            def emit(conv):
                store = functools.partial(_store_scores, builder, nr, r0v, sptr, sstride, c0v, accs)
                if conv != "bf16":
                    _qk_loop(builder, conv, nr, D, qptr, r0v, kptr, kbase, step, accs)
                    store()
                elif not HAS_DPBF16:
                    pairs(use_dp=False)
                    store()
                else:                          # runtime choice: dp > 0 means q is bf16-exact
                    with builder.if_else(builder.fcmp_ordered(">", dpv, ir.Constant(_F32, 0.0))) as (yes, no):
                        with yes:
                            pairs(use_dp=True)
                            store(_splat(builder, dpv))
                        with no:
                            pairs(use_dp=False)
                            store()

            _by_storage(context, builder, sig.args[3], args[8], sig.args[8], emit)
            return context.get_dummy_value()

        return types.void(qs, qp, r0, kt, blk, nxt, S, c0, code, dp), codegen

    return qk


def _qk_loop(builder, conv, nr, D, qptr, r0v, kptr, kbase, step, accs):
    for a in accs:
        builder.store(_vf(0.0), a)
    with cgutils.for_range(builder, D) as loop:
        d = loop.index
        koff = builder.add(kbase, builder.mul(d, ir.Constant(_I64, BK)))
        _prefetch_ahead(builder, kptr, koff, step, conv, 2 * W)
        k0 = _load_vec(builder, kptr, koff, conv)
        k1 = _load_vec(builder, kptr, builder.add(koff, ir.Constant(_I64, W)), conv)
        for i in range(nr):
            row = builder.add(r0v, ir.Constant(_I64, i))
            qv = _splat(builder, builder.load(builder.gep(qptr, [builder.add(builder.mul(row, D), d)])))
            builder.store(_fmuladd(builder, qv, k0, builder.load(accs[2 * i])), accs[2 * i])
            builder.store(_fmuladd(builder, qv, k1, builder.load(accs[2 * i + 1])), accs[2 * i + 1])


def _qk_pairs(builder, nr, D, qptr, qpptr, r0v, kptr, kbase, step, accs, use_dp):
    """bf16 K in pair-interleaved blocks [D/2, BK, 2]: lane j of the i32 vector at pair p
    holds (k[2p, j] | k[2p+1, j] << 16)."""
    for a in accs:
        builder.store(_vf(0.0), a)
    half = builder.lshr(D, ir.Constant(_I64, 1))
    with cgutils.for_range(builder, half) as loop:
        p = loop.index
        koff = builder.add(kbase, builder.mul(p, ir.Constant(_I64, 2 * BK)))
        _prefetch_ahead(builder, kptr, koff, step, "bf16", 4 * W)
        x = [_load_ivec(builder, kptr, koff), _load_ivec(builder, kptr, builder.add(koff, ir.Constant(_I64, 2 * W)))]
        if use_dp:
            for i in range(nr):
                row = builder.add(r0v, ir.Constant(_I64, i))
                qw = builder.load(builder.gep(qpptr, [builder.add(builder.mul(row, half), p)]))
                qv = builder.shuffle_vector(builder.insert_element(ir.Constant(_VI, ir.Undefined), qw, ir.Constant(_I32, 0)),
                                            ir.Constant(_VI, ir.Undefined), ir.Constant(_VI, [0] * W))
                for c in range(2):
                    builder.store(_dpbf16(builder, builder.load(accs[2 * i + c]), qv, x[c]), accs[2 * i + c])
        else:
            even = [builder.bitcast(builder.shl(v, ir.Constant(_VI, [16] * W)), _VF) for v in x]
            odd = [builder.bitcast(builder.and_(v, ir.Constant(_VI, [-65536] * W)), _VF) for v in x]
            d0 = builder.shl(p, ir.Constant(_I64, 1))
            for i in range(nr):
                row = builder.add(r0v, ir.Constant(_I64, i))
                qa = builder.gep(qptr, [builder.add(builder.mul(row, D), d0)])
                q0 = _splat(builder, builder.load(qa))
                q1 = _splat(builder, builder.load(builder.gep(qa, [ir.Constant(_I64, 1)])))
                for c in range(2):
                    acc = _fmuladd(builder, q0, even[c], builder.load(accs[2 * i + c]))
                    builder.store(_fmuladd(builder, q1, odd[c], acc), accs[2 * i + c])


def _store_scores(builder, nr, r0v, sptr, sstride, c0v, accs, scale=None):
    for i in range(nr):
        row = builder.add(r0v, ir.Constant(_I64, i))
        soff = builder.add(builder.mul(row, sstride), c0v)
        for half in range(2):
            p = builder.gep(sptr, [builder.add(soff, ir.Constant(_I64, half * W))])
            acc = builder.load(accs[2 * i + half])
            if scale is not None:
                acc = builder.fmul(acc, scale)
            builder.store(acc, builder.bitcast(p, _VF.as_pointer()), align=4)


def _make_pv(nr):
    @intrinsic
    def pv(typingctx, P, r0, c0, vt, blk, nxt, n, o, code):
        if not (_f32_ok(P) and _f32_ok(o) and _storage_ok(vt, 4)
                and all(isinstance(x, types.Integer) for x in (r0, c0, blk, nxt, n, code))):
            return None

        def codegen(context, builder, sig, args):
            pptr, (_, pstride) = _data(context, builder, sig.args[0], args[0])
            vptr, (_, nchunks, _, _) = _data(context, builder, sig.args[3], args[3])
            optr, (_, D) = _data(context, builder, sig.args[7], args[7])
            r0v, c0v, blkv, nxtv, nv = (context.cast(builder, args[k], sig.args[k], types.int64) for k in (1, 2, 4, 5, 6))
            pptr = builder.gep(pptr, [c0v])
            vbase = builder.mul(blkv, builder.mul(D, ir.Constant(_I64, BK)))   # start of block blk
            step = _block_step(builder, blkv, nxtv, D)
            accs = [cgutils.alloca_once(builder, _VF) for _ in range(nr)]
            _by_storage(context, builder, sig.args[3], args[8], sig.args[8],
                        lambda conv: _pv_loop(builder, conv, nr, D, nchunks, pptr, pstride, r0v, vptr, vbase, step,
                                              nv, optr, accs))
            return context.get_dummy_value()

        return types.void(P, r0, c0, vt, blk, nxt, n, o, code), codegen

    return pv


def _pv_loop(builder, conv, nr, D, nchunks, pptr, pstride, r0v, vptr, vbase, step, nv, optr, accs):
    with cgutils.for_range(builder, nchunks) as chunk:
        col = builder.mul(chunk.index, ir.Constant(_I64, W))
        optrs = []
        for i in range(nr):
            row = builder.add(r0v, ir.Constant(_I64, i))
            p = builder.bitcast(builder.gep(optr, [builder.add(builder.mul(row, D), col)]), _VF.as_pointer())
            optrs.append(p)
            builder.store(builder.load(p, align=4), accs[i])
        with cgutils.for_range(builder, nv) as loop:
            jj = loop.index
            panel = builder.add(vbase, builder.mul(chunk.index, ir.Constant(_I64, BK * W)))
            voff = builder.add(panel, builder.mul(jj, ir.Constant(_I64, W)))
            _prefetch_ahead(builder, vptr, voff, step, conv, W)
            v = _load_vec(builder, vptr, voff, conv)
            for i in range(nr):
                row = builder.add(r0v, ir.Constant(_I64, i))
                pw = builder.load(builder.gep(pptr, [builder.add(builder.mul(row, pstride), jj)]))
                builder.store(_fmuladd(builder, _splat(builder, pw), v, builder.load(accs[i])), accs[i])
        for i in range(nr):
            builder.store(builder.load(accs[i]), optrs[i], align=4)


qk1, qk2, qk4 = (_make_qk(nr) for nr in (1, 2, 4))
pv1, pv2, pv4 = (_make_pv(nr) for nr in (1, 2, 4))



def _vfn(builder, name, nargs):
    """LLVM's vector intrinsic llvm.<name>.v16f32 of `nargs` <16 x float> operands."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * nargs), f"llvm.{name}.v{W}f32")


EXP_MIN = -87.0
_EXP_C = [1.0, 1.0, 0.5, 1 / 6, 1 / 24, 1 / 120, 1 / 720, 1 / 5040]   # e**y Taylor, degree 7


def _exp(builder, x):
    """exp(x) per lane for x <= 0, 0 below EXP_MIN (so -inf gives 0): 2**n e**y with
    n = round(x / ln2), y = x - n ln2 (Cody-Waite, ln2 in two parts, so |y| <= ln2/2 exactly),
    e**y by the degree-7 Taylor polynomial: within 2 ulp."""
    xc = builder.call(_vfn(builder, "maxnum", 2), [x, _vf(EXP_MIN)])
    n = builder.call(_vfn(builder, "floor", 1), [_fmuladd(builder, xc, _vf(1.4426950408889634), _vf(0.5))])
    y = _fmuladd(builder, n, _vf(-0.693145751953125), xc)       # ln2 high part: n * it is exact
    y = _fmuladd(builder, n, _vf(-1.428606765330187e-06), y)    # ln2 low part
    p = _vf(_EXP_C[-1])
    for c in reversed(_EXP_C[:-1]):
        p = _fmuladd(builder, p, y, _vf(c))
    e = builder.shl(builder.add(builder.fptosi(n, _VI), ir.Constant(_VI, [127] * W)), ir.Constant(_VI, [23] * W))
    v = builder.fmul(p, builder.bitcast(e, _VF))                # p * 2**n
    return builder.select(builder.fcmp_ordered(">=", x, _vf(EXP_MIN)), v, _vf(0.0))


def _row_ok(S, r, w, x):
    return _f32_ok(S) and isinstance(r, types.Integer) and isinstance(w, types.Integer) and x == types.float32


def _row(context, builder, sig, args):
    """Pointer to S[r, 0] and the number of W-vectors in w, from a row intrinsic's (S, r, w, ...)."""
    sptr, (_, stride) = _data(context, builder, sig.args[0], args[0])
    rv, wv = (context.cast(builder, args[k], sig.args[k], types.int64) for k in (1, 2))
    return builder.gep(sptr, [builder.mul(rv, stride)]), builder.udiv(wv, ir.Constant(_I64, W))


@intrinsic
def rowmax(typingctx, S, r, w, init):
    if not _row_ok(S, r, w, init):
        return None

    def codegen(context, builder, sig, args):
        base, nvec = _row(context, builder, sig, args)
        acc = cgutils.alloca_once(builder, _VF)
        builder.store(_splat(builder, args[3]), acc)
        with cgutils.for_range(builder, nvec) as loop:
            x = _load_vec(builder, base, builder.mul(loop.index, ir.Constant(_I64, W)), "f32")
            builder.store(builder.call(_vfn(builder, "maxnum", 2), [builder.load(acc), x]), acc)
        red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_VF]),
                                             f"llvm.vector.reduce.fmax.v{W}f32")
        return builder.call(red, [builder.load(acc)])

    return types.float32(S, r, w, init), codegen


@intrinsic
def exp_row(typingctx, S, r, w, bm):
    if not _row_ok(S, r, w, bm):
        return None

    def codegen(context, builder, sig, args):
        base, nvec = _row(context, builder, sig, args)
        bmv = _splat(builder, args[3])
        acc = cgutils.alloca_once(builder, _VF)
        builder.store(_vf(0.0), acc)
        with cgutils.for_range(builder, nvec) as loop:
            ptr = builder.bitcast(builder.gep(base, [builder.mul(loop.index, ir.Constant(_I64, W))]), _VF.as_pointer())
            v = _exp(builder, builder.fsub(builder.load(ptr, align=4), bmv))
            builder.store(v, ptr, align=4)
            builder.store(builder.fadd(builder.load(acc), v), acc)
        red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, _VF]),
                                             f"llvm.vector.reduce.fadd.v{W}f32")
        return builder.call(red, [ir.Constant(_F32, 0.0), builder.load(acc)])

    return types.float32(S, r, w, bm), codegen


@intrinsic
def exp_neg(typingctx, x):
    """exp(x) of one float32 x <= 0 by the same formula (the softmax's rescale factor)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(_exp(builder, _splat(builder, args[0])), ir.Constant(_I32, 0))

    return types.float32(x), codegen
