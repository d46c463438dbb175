"""Fused quantization kernels: quantize along dim 0 and write the transposed fp8 layout in one go.

The gradient GEMMs contract over the outer dims of row-major activations, gradients and weights; ``torch._scaled_mm``
wants A row-major and B column-major, so these operands are quantized along dim 0 and stored transposed: (1) column
amax over ``[CHUNK_M, BLOCK_K]`` slabs combined with ``atomic_max``; (2) cast of ``[BLOCK_M, BLOCK_K]`` tiles, stored
transposed. Also: row-wise (one or many tensors per launch), fp8 transpose, per-group columns, the decode GEMM.
Imports only :mod:`fp8tensor.core`; :mod:`fp8tensor.quantize` decides when a kernel runs.
"""
from __future__ import annotations

import importlib
import math
import types
from collections.abc import Mapping
from typing import Optional

import torch

from ..core import capture, compat

__all__ = [
    "kernel_available", "launch_dim0_t", "both_kernels_available", "launch_both", "quantize_last_dim",
    "quantize_last_dim_group",
    "row_kernel_available",
    "eager_launch_ok", "transpose_available", "launch_transpose", "quantize_last_dim_group_into",
    "cast_rows_t_available", "launch_cast_rows_t",
    "group_col_chunks", "group_col_kernel_available", "group_col_layout_ok", "launch_group_cols_t",
    "w8_mm_available", "launch_w8_mm", "w8_mm_split", "launch_w8_mm_partials", "W8_MM_CONFIG",
]

try:  # Triton is only present with CUDA builds of torch.
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - CPU-only environments
    _HAS_TRITON = False

#: Whether Triton is importable (the kernels of this module exist).
HAS_TRITON = _HAS_TRITON


if _HAS_TRITON:

    @triton.jit
    def _col_amax_kernel(x_ptr, amax_ptr, M, K, stride_m, CHUNK_M: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        pid_k = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for i in range(0, CHUNK_M, BLOCK_M):
            offs_m = pid_m * CHUNK_M + i + tl.arange(0, BLOCK_M)
            mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            a = tl.abs(x)
            a = tl.where(a != a, float("inf"), a)  # NaN -> inf: the column's scale becomes inf, output non-finite
            acc = tl.maximum(acc, tl.max(a, axis=0))
        tl.atomic_max(amax_ptr + offs_k, acc, mask=offs_k < K)

    @triton.jit
    def _cast_t_kernel(x_ptr, amax_ptr, q_ptr, scale_ptr, M, K, stride_m, FMAX: tl.constexpr, EPS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        amax = tl.load(amax_ptr + offs_k, mask=kmask, other=1.0)
        scale = tl.maximum(amax / FMAX, EPS)  # fp8tensor.quantize.amax_to_scale: max(amax / fmax, floor)
        mask = (offs_m[:, None] < M) & kmask[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x / scale[None, :]
        y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
        q = tl.trans(y.to(q_ptr.dtype.element_ty))
        tl.store(q_ptr + offs_k[:, None] * M + offs_m[None, :], q, mask=kmask[:, None] & (offs_m[None, :] < M))
        if pid_m == 0:
            tl.store(scale_ptr + offs_k, scale, mask=kmask)

    @triton.jit
    def _amax_both_kernel(x_ptr, amax_ptr, M, K, stride_m, CHUNK_M: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        # Row amax (amax[:M]) and column amax (amax[M:]) of (M, K) in one read. Program (k, m): columns
        # [k * BLOCK_K, +BLOCK_K) over rows [m * CHUNK_M, +CHUNK_M), [BLOCK_M, BLOCK_K] tiles down the rows. The
        # column maxima stay elementwise in registers (one cross-warp reduction per program); each tile's row maxima
        # (a reduction along K, within a warp) go to the rows' amax by atomics.
        offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        cacc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for i in range(0, CHUNK_M, BLOCK_M):
            offs_m = tl.program_id(1) * CHUNK_M + i + tl.arange(0, BLOCK_M)
            mmask = offs_m < M
            x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_m + offs_k[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0)
            a = tl.abs(x.to(tl.float32))
            a = tl.where(a != a, float("inf"), a)  # NaN -> inf: its row and column get an infinite scale
            cacc = tl.maximum(cacc, a)
            tl.atomic_max(amax_ptr + offs_m, tl.max(a, axis=1), mask=mmask, sem="relaxed")
        tl.atomic_max(amax_ptr + M + offs_k, tl.max(cacc, axis=0), mask=kmask, sem="relaxed")

    @triton.jit
    def _cast_both_kernel(x_ptr, ra_ptr, ca_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, stride_m, FMAX: tl.constexpr,
                          EPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # One read of a [BLOCK_M, BLOCK_K] tile, both layouts written: q (M, K) per row, qt (K, M) per column. x times
        # the scale's IEEE reciprocal (two IEEE divisions per element made this kernel compute-bound).
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        kmask = offs_k < K
        rs = tl.maximum(tl.load(ra_ptr + offs_m, mask=mmask, other=1.0) / FMAX, EPS)  # row scales: amax_to_scale
        cs = tl.maximum(tl.load(ca_ptr + offs_k, mask=kmask, other=1.0) / FMAX, EPS)
        mask = mmask[:, None] & kmask[None, :]
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_m + offs_k[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        y = tl.clamp(x * tl.div_rn(1.0, rs)[:, None], -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
        z = tl.clamp(x * tl.div_rn(1.0, cs)[None, :], -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(qt_ptr + offs_k.to(tl.int64)[:, None] * M + offs_m[None, :], tl.trans(z.to(qt_ptr.dtype.element_ty)),
                 mask=kmask[:, None] & mmask[None, :])
        if pid_k == 0:
            tl.store(s_ptr + offs_m, rs, mask=mmask)
        if pid_m == 0:
            tl.store(st_ptr + offs_k, cs, mask=kmask)

    @triton.jit
    def _row_tile(x_ptr, rows, offs_k, mask, K, c_ptr, c_rows, HAS_C: tl.constexpr, G_BLOCK: tl.constexpr):
        # The float32 tile of the rows at columns offs_k (HAS_C: times the column multipliers, per group if G_BLOCK)
        x = tl.load(x_ptr + rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_C:
            if G_BLOCK > 0:
                x = x * tl.load(c_ptr + c_rows + offs_k[None, :], mask=mask, other=0.0)
            else:
                x = x * tl.load(c_ptr + offs_k, mask=offs_k < K, other=0.0)[None, :]
        return x

    @triton.jit
    def _row_tile_amax(x):
        a = tl.abs(x)
        a = tl.where(a != a, float("inf"), a)  # NaN -> inf: the row's scale becomes inf, output non-finite
        return tl.max(a, axis=1)

    @triton.jit
    def _store_row_tile(q_ptr, rows, offs_k, mask, x, scale, FMAX: tl.constexpr):
        y = tl.div_rn(x, scale[:, None])
        y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + rows + offs_k[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_rows(x_ptr, q_ptr, scale_ptr, offs_m, M, K, FMAX: tl.constexpr, EPS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, c_ptr, HAS_C: tl.constexpr, ends_ptr, G,
                       G_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr = False):
        # Rows offs_m of a row-major (M, K) tensor (HAS_C: times the float32 column multipliers c, in float32):
        # one pass for the row amax, one (mostly from L2) to divide, saturate, cast and store; ONE_TILE (K <=
        # BLOCK_K): the rows read once, held in registers for the cast. G_BLOCK > 0: c is (G, K), one row of
        # multipliers per token group, and row m takes c's row of its group (the number of cumulative group ends
        # ends[:G] <= m, at most G - 1: rows past the last end take the last group's). The scale is the dim-0
        # kernel's expression, equal to the eager CUDA scale.
        mmask = offs_m < M
        rows = offs_m.to(tl.int64)[:, None] * K
        c_rows = rows
        if G_BLOCK > 0:
            offs_g = tl.arange(0, G_BLOCK)
            ends = tl.load(ends_ptr + offs_g, mask=offs_g < G, other=2**31 - 1)
            gid = tl.sum((ends[None, :] <= offs_m[:, None]).to(tl.int32), axis=1)
            c_rows = tl.minimum(gid, G - 1).to(tl.int64)[:, None] * K
        if ONE_TILE:
            offs_k = tl.arange(0, BLOCK_K)
            mask = mmask[:, None] & (offs_k[None, :] < K)
            x = _row_tile(x_ptr, rows, offs_k, mask, K, c_ptr, c_rows, HAS_C, G_BLOCK)
            scale = tl.maximum(_row_tile_amax(x) / FMAX, EPS)
            tl.store(scale_ptr + offs_m, scale, mask=mmask)
            _store_row_tile(q_ptr, rows, offs_k, mask, x, scale, FMAX)
        else:
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask = mmask[:, None] & (offs_k[None, :] < K)
                acc = tl.maximum(acc, _row_tile_amax(_row_tile(x_ptr, rows, offs_k, mask, K, c_ptr, c_rows, HAS_C,
                                                                G_BLOCK)))
            scale = tl.maximum(acc / FMAX, EPS)
            tl.store(scale_ptr + offs_m, scale, mask=mmask)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask = mmask[:, None] & (offs_k[None, :] < K)
                x = _row_tile(x_ptr, rows, offs_k, mask, K, c_ptr, c_rows, HAS_C, G_BLOCK)
                _store_row_tile(q_ptr, rows, offs_k, mask, x, scale, FMAX)

    @triton.jit
    def _row_quant_kernel(x_ptr, c_ptr, q_ptr, scale_ptr, M, K, ends_ptr, G, FMAX: tl.constexpr, EPS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_C: tl.constexpr,
                          G_BLOCK: tl.constexpr, ONE_TILE: tl.constexpr = False):
        # BLOCK_M rows per program; the bits of the eager CUDA ops: x / scale as an IEEE division (div_rn; Triton's
        # plain '/' on float32 is approximate, eager CUDA divides tensor by tensor exactly).
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        _quantize_rows(x_ptr, q_ptr, scale_ptr, offs_m, M, K, FMAX, EPS, BLOCK_M, BLOCK_K, c_ptr, HAS_C, ends_ptr, G,
                       G_BLOCK, ONE_TILE)

    @triton.jit
    def _row_quant_group_kernel(table_ptr, N_T: tl.constexpr, FMAX: tl.constexpr, EPS: tl.constexpr,
                                X_TY: tl.constexpr, Q_TY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                ALIGNED: tl.constexpr):
        # _row_quant_kernel over N_T tensors in one launch. table (int64, 6 x N_T): x / q / scale addresses, M, K and
        # the first program of each tensor.
        pid = tl.program_id(0)
        t = 0
        for i in tl.static_range(1, N_T):
            t = tl.where(pid >= tl.load(table_ptr + 5 * N_T + i), i, t)
        x_ptr = tl.load(table_ptr + t).to(tl.pointer_type(X_TY))
        q_ptr = tl.load(table_ptr + N_T + t).to(tl.pointer_type(Q_TY))
        scale_ptr = tl.load(table_ptr + 2 * N_T + t).to(tl.pointer_type(tl.float32))
        M = tl.load(table_ptr + 3 * N_T + t)
        K = tl.load(table_ptr + 4 * N_T + t)
        first = tl.load(table_ptr + 5 * N_T + t)
        if ALIGNED:  # every K and x / q address a multiple of 16: lets the compiler vectorize (as for a kernel arg)
            K = tl.multiple_of(K, 16)
            x_ptr = tl.multiple_of(x_ptr, 16)
            q_ptr = tl.multiple_of(q_ptr, 16)
        offs_m = (pid - first) * BLOCK_M + tl.arange(0, BLOCK_M)
        _quantize_rows(x_ptr, q_ptr, scale_ptr, offs_m, M, K, FMAX, EPS, BLOCK_M, BLOCK_K, x_ptr, False, x_ptr, 0,
                       0)

    @triton.jit
    def _transpose_kernel(src_ptr, dst_ptr, M, N, stride_m, stride_b, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # dst[b] (N, M) row-major = src[b] (M, N) transposed (row stride stride_m, unit column stride; matrix b at
        # src_ptr + b * stride_b, dst_ptr + b * M * N)
        b = tl.program_id(2).to(tl.int64)
        src_ptr += b * stride_b
        dst_ptr += b * M * N
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        x = tl.load(src_ptr + offs_m.to(tl.int64)[:, None] * stride_m + offs_n[None, :], mask=mask)
        tl.store(dst_ptr + offs_n.to(tl.int64)[:, None] * M + offs_m[None, :], tl.trans(x),
                 mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))

    @triton.jit
    def _cast_rows_t_kernel(src_ptr, s_ptr, dst_ptr, M, N, stride_m, stride_b, FMAX: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # dst[b] (N, M) row-major = the rows of src[b] (M, N) divided by their scales s[b] (M,), saturated, cast and
        # transposed (src: row stride stride_m, unit column stride, matrix b at src_ptr + b * stride_b; s contiguous
        # (B, M); dst at dst_ptr + b * M * N). The row kernel's arithmetic: the same bits for the same scales.
        b = tl.program_id(2).to(tl.int64)
        src_ptr += b * stride_b
        s_ptr += b * M
        dst_ptr += b * M * N
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        x = tl.load(src_ptr + offs_m.to(tl.int64)[:, None] * stride_m + offs_n[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        scale = tl.load(s_ptr + offs_m, mask=offs_m < M, other=1.0)
        y = tl.div_rn(x, scale[:, None])
        y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
        q = tl.trans(y.to(dst_ptr.dtype.element_ty))
        tl.store(dst_ptr + offs_n.to(tl.int64)[:, None] * M + offs_m[None, :], q,
                 mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))

    @triton.jit
    def _group_col_rows(x_ptr, start, r, size, M, offs_c, cmask, stride_xm):
        # The float32 tile of the group's rows r (rows past its size, or past M: zeros) at columns offs_c
        rows = start + r
        m = (r < size) & (rows < M)
        return tl.load(x_ptr + rows[:, None] * stride_xm + offs_c[None, :], mask=m[:, None] & cmask[None, :],
                       other=0.0).to(tl.float32)

    @triton.jit
    def _group_col_amax(x_ptr, start, r_begin, r_end, size, M, offs_c, cmask, stride_xm, BLOCK_M: tl.constexpr,
                        BLOCK_C: tl.constexpr):
        # The column amax of the group's rows [r_begin, min(r_end, size)) (NaN -> inf: the column's scale becomes
        # inf, its output non-finite)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r0 in range(r_begin, tl.minimum(r_end, size), BLOCK_M):
            a = tl.abs(_group_col_rows(x_ptr, start, r0 + tl.arange(0, BLOCK_M), size, M, offs_c, cmask, stride_xm))
            a = tl.where(a != a, float("inf"), a)
            acc = tl.maximum(acc, tl.max(a, axis=0))
        return acc

    @triton.jit
    def _group_col_cast_t(x_ptr, q_base, start, dst0, r_begin, r_end, size, M, offs_c, cmask, scale, stride_xm,
                          stride_qc, Q_COLS, FMAX: tl.constexpr, BLOCK_M: tl.constexpr):
        # The group's rows [r_begin, r_end) (zeros past its size) divided by the column scales, saturated, cast and
        # stored transposed: row r to column dst0 + r of q (columns below Q_COLS)
        for r0 in range(r_begin, r_end, BLOCK_M):
            r = r0 + tl.arange(0, BLOCK_M)
            x = _group_col_rows(x_ptr, start, r, size, M, offs_c, cmask, stride_xm)
            y = tl.div_rn(x, scale[None, :])
            y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
            q = tl.trans(y.to(q_base.dtype.element_ty))
            dst = dst0 + r
            smask = cmask[:, None] & ((r < r_end) & (dst < Q_COLS))[None, :]
            tl.store(q_base + offs_c.to(tl.int64)[:, None] * stride_qc + dst[None, :], q, mask=smask)

    @triton.jit
    def _group_col_chunk(ends_ptr, g, s, S, ALIGN: tl.constexpr, MIN_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        # Group g's first row, its size, and chunk s of S of its padded rows [0, psize) (BLOCK_M-row multiples)
        end = tl.load(ends_ptr + g).to(tl.int64)
        start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
        size = tl.maximum(end - start, 0)
        psize = tl.maximum((size + ALIGN - 1) // ALIGN * ALIGN, MIN_PAD)
        chunk = (psize + S * BLOCK_M - 1) // (S * BLOCK_M) * BLOCK_M
        r_begin = s * chunk
        return start, size, r_begin, tl.minimum(r_begin + chunk, psize)

    @triton.jit
    def _group_col_quant_t_kernel(x_ptr, ends_ptr, dst_ptr, q_ptr, scale_ptr, M, C, stride_xm, stride_qg, stride_qc,
                                  Q_COLS, FMAX: tl.constexpr, EPS: tl.constexpr, ALIGN: tl.constexpr,
                                  MIN_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
        # Program (pid_c, g): columns pid_c * BLOCK_C ... of rows [ends[g-1], ends[g]) of x; see launch_group_cols_t.
        # Two passes over the group's rows: the column amax, then the cast (mostly from L2).
        pid_c = tl.program_id(0)
        g = tl.program_id(1)
        start, size, r_begin, r_end = _group_col_chunk(ends_ptr, g, 0, 1, ALIGN, MIN_PAD, BLOCK_M)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = offs_c < C
        acc = _group_col_amax(x_ptr, start, 0, r_end, size, M, offs_c, cmask, stride_xm, BLOCK_M, BLOCK_C)
        scale = tl.maximum(acc / FMAX, EPS)
        tl.store(scale_ptr + g * C + offs_c, scale, mask=cmask)
        _group_col_cast_t(x_ptr, q_ptr + g.to(tl.int64) * stride_qg, start, tl.load(dst_ptr + g).to(tl.int64), 0,
                          r_end, size, M, offs_c, cmask, scale, stride_xm, stride_qc, Q_COLS, FMAX, BLOCK_M)

    @triton.jit
    def _group_col_amax_kernel(x_ptr, ends_ptr, amax_ptr, M, C, stride_xm, S, ALIGN: tl.constexpr,
                               MIN_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
        # Split form, first launch. Program (pid_c, s, g): the column amax of chunk s of group g's rows, atomically
        # maxed into amax[g] (float32 (G, C), zeros before the launch)
        pid_c = tl.program_id(0)
        s = tl.program_id(1)
        g = tl.program_id(2)
        start, size, r_begin, r_end = _group_col_chunk(ends_ptr, g, s, S, ALIGN, MIN_PAD, BLOCK_M)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = offs_c < C
        acc = _group_col_amax(x_ptr, start, r_begin, r_end, size, M, offs_c, cmask, stride_xm, BLOCK_M, BLOCK_C)
        tl.atomic_max(amax_ptr + g * C + offs_c, acc, mask=cmask & ((offs_c * 0 + r_begin) < size), sem="relaxed")

    @triton.jit
    def _group_col_cast_t_kernel(x_ptr, ends_ptr, dst_ptr, amax_ptr, q_ptr, scale_ptr, M, C, stride_xm, stride_qg,
                                 stride_qc, Q_COLS, S, FMAX: tl.constexpr, EPS: tl.constexpr, ALIGN: tl.constexpr,
                                 MIN_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
        # Split form, second launch. Program (pid_c, s, g): chunk s of group g's padded rows cast with the scales of
        # amax[g] (the one-launch kernel's expression); chunk 0 stores the scales
        pid_c = tl.program_id(0)
        s = tl.program_id(1)
        g = tl.program_id(2)
        start, size, r_begin, r_end = _group_col_chunk(ends_ptr, g, s, S, ALIGN, MIN_PAD, BLOCK_M)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = offs_c < C
        scale = tl.maximum(tl.load(amax_ptr + g * C + offs_c, mask=cmask, other=0.0) / FMAX, EPS)
        tl.store(scale_ptr + g * C + offs_c, scale, mask=cmask & ((offs_c * 0 + s) == 0))
        _group_col_cast_t(x_ptr, q_ptr + g.to(tl.int64) * stride_qg, start, tl.load(dst_ptr + g).to(tl.int64),
                          r_begin, r_end, size, M, offs_c, cmask, scale, stride_xm, stride_qc, Q_COLS, FMAX, BLOCK_M)


# ---------------------------------------------------------------------------------------------- eager launches
# Triton >= 3.3: CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook,
# exit_hook, *arguments), the call JITFunction.run itself makes (triton.knobs exists from Triton 3.3).
try:
    _KNOBS = (importlib.import_module("triton.knobs")
              if _HAS_TRITON and tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 3) else None)
except Exception:  # pragma: no cover - unknown Triton layout
    _KNOBS = None
_FAST_OK = _KNOBS is not None
#: Triton's hook-chain class (``knobs.runtime.launch_enter_hook`` is one, never None, from Triton 3.5): a chain
#: with no hook calls nothing, so the launch passes no hooks and builds no launch metadata (as before 3.5).
_HOOK_CHAIN = getattr(_KNOBS, "HookChain", None)
_LAUNCHERS: dict = {}


def _launcher(fn) -> "_Launcher":
    """The :class:`_Launcher` of JIT kernel ``fn`` (one per kernel)."""
    launcher = _LAUNCHERS.get(fn)
    if launcher is None:
        launcher = _LAUNCHERS[fn] = _Launcher(fn)
    return launcher


def _launch(fn, grid: tuple, args: tuple, consts: dict, num_warps: int, device: torch.device,
            num_stages: Optional[int] = None, *, traced: bool = False) -> None:
    """Launch JIT kernel ``fn``: through ``wrap_triton`` when ``traced`` (the body of a ``triton_op``), Triton's own
    launch off CUDA (its interpreter), else the eager :class:`_Launcher`."""
    if not traced and device.type == "cuda":
        _launcher(fn)(grid, args, consts, num_warps, device, num_stages)
        return
    from torch.library import wrap_triton

    opts = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    (wrap_triton(fn) if traced else fn)[grid](*args, **consts, **opts)


_INT32 = (-(2**31), 2**31)


#: The largest finite value of each fp8 dtype (``torch.finfo(dt).max``, which costs ~0.5 µs per call from Python).
_FMAX = types.MappingProxyType({dt: torch.finfo(dt).max for dt in (torch.float8_e4m3fn, torch.float8_e5m2)})


def _fmax(dt: torch.dtype) -> float:
    """``torch.finfo(dt).max`` (looked up for the fp8 dtypes)."""
    v = _FMAX.get(dt)
    return torch.finfo(dt).max if v is None else v


def _cdiv(x, y):
    """``triton.cdiv`` (the same expression, also of symbolic sizes) without the µs of a Triton
    ``constexpr_function`` call from Python (launch grids are computed on every eager launch)."""
    return (x + (y - 1)) // y


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` of an int (the same bit operations), called as a plain function."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    return n + 1


class _Launcher:
    """Eager launches of one ``@triton.jit`` kernel: the first launch of each argument class (a superset of what
    Triton specializes on) goes through Triton's JIT, later ones call the compiled kernel's ``run`` directly.

    The parameters after ``args`` (constexprs and defaults) are read from ``consts`` once per :class:`LaunchConsts`
    (immutable; the memoized launch plans pass the same one on every call), with their part of the key; any other
    mapping is read on every call."""

    __slots__ = ("fn", "names", "is_constexpr", "defaults", "cache", "tails")

    def __init__(self, fn):
        self.fn = fn
        params = fn.params
        self.names = [p.name for p in params]
        self.is_constexpr = [bool(p.is_constexpr) for p in params]
        self.defaults = {p.name: p.default for p in params if getattr(p, "has_default", False)}
        self.cache: dict = {}
        self.tails: dict = {}

    def _tail(self, n: int, consts) -> tuple:
        """``(values, key)`` of the parameters after the first ``n``: their values in signature order (from
        ``consts``, else the defaults) and their part of the launch key."""
        names, defaults = self.names, self.defaults
        values = tuple(consts[name] if name in consts else defaults[name] for name in names[n:])
        return values, _arg_classes(values, self.is_constexpr[n:])

    def __call__(self, grid: tuple, args: tuple, consts, num_warps: int, device: torch.device,
                 num_stages: Optional[int] = None) -> None:
        cur = torch.cuda.current_device()
        idx = cur if device.index is None else device.index
        if cur != idx:  # Triton launches on the current device
            with torch.cuda.device(idx):
                return self(grid, args, consts, num_warps, device, num_stages)
        if not _FAST_OK:
            opts = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps,
                                                                            num_stages=num_stages)
            self.fn[grid](*args, **consts, **opts)
            return None
        n = len(args)
        if type(consts) is LaunchConsts:  # immutable: its tail once (the entry keeps it alive)
            memo = self.tails.get(id(consts))
            if memo is None or memo[0] is not consts or memo[1] != n:
                if len(self.tails) >= 256:
                    self.tails.clear()
                memo = self.tails[id(consts)] = (consts, n, *self._tail(n, consts))
            tail, tail_key = memo[2], memo[3]
        else:
            tail, tail_key = self._tail(n, consts)
        key = (idx, num_warps, num_stages, tail_key, _arg_classes(args, self.is_constexpr))
        kernel = self.cache.get(key)
        if kernel is None:
            opts = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps,
                                                                            num_stages=num_stages)
            kernel = self.fn[grid](*args, **consts, **opts)
            if kernel is not None and hasattr(kernel, "run") and hasattr(kernel, "packed_metadata"):
                if len(self.cache) >= 64:
                    self.cache.clear()
                self.cache[key] = kernel
            return None
        stream = compat.raw_cuda_stream(idx)
        gx, gy, gz = (*grid, 1, 1)[:3]
        runtime = _KNOBS.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if ((enter is None or (type(enter) is _HOOK_CHAIN and not enter.calls))
                and (leave is None or (type(leave) is _HOOK_CHAIN and not leave.calls))):
            kernel.run(gx, gy, gz, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)
            return None
        meta = kernel.launch_metadata(grid, stream, *args, *tail) if enter is not None else None
        kernel.run(gx, gy, gz, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *args, *tail)
        return None


class LaunchConsts(Mapping):
    """A launch's constexprs as an immutable mapping (a copy of ``values``; no method changes it): the eager
    launcher reads the launch-key part of one such object once (:class:`_Launcher`)."""

    __slots__ = ("_items",)

    def __init__(self, values: dict):
        self._items = dict(values)

    def __getitem__(self, name):
        return self._items[name]

    def __contains__(self, name) -> bool:
        return name in self._items

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"LaunchConsts({self._items!r})"


def _arg_classes(values, is_constexpr) -> tuple:
    """The launch-key part of launch arguments ``values`` (``is_constexpr`` per value, from the first): a
    constexpr's value, an integer's specialization class, a tensor's dtype and 16-byte alignment, else type and
    value."""
    key = []
    add, int_classes = key.append, _INT_CLASSES
    for a, const in zip(values, is_constexpr):
        if const:
            add(a)
        elif type(a) is int:
            c = int_classes.get(a)
            if c is None:
                c = (a == 1, a % 16 == 0, _INT32[0] <= a < _INT32[1], a < 2**63)
                if len(int_classes) < 4096:
                    int_classes[a] = c
            add(c)
        elif isinstance(a, torch.Tensor):
            add((a.dtype, not a.data_ptr() & 15))
        else:
            add((type(a), a))
    return tuple(key)


#: Triton's specialization class of an integer argument (1, a multiple of 16, 32- or 64-bit), by value: a memo of a
#: pure function, bounded (sizes, strides and token counts repeat from launch to launch).
_INT_CLASSES: dict = {}


def _frozen(d: dict) -> types.MappingProxyType:
    """A read-only view of ``d`` (nested too): tile tables are constants (some set bits, e.g. the decode GEMM's
    summation order, and launch plans are cached from them); tune them by editing this file."""
    return types.MappingProxyType({k: _frozen(v) if isinstance(v, dict) else v for k, v in d.items()})


#: Tiles of the dim-0 kernels (tuned on H200 over the e2e models' shapes, sweep at commit b44f11a; same bits for any).
CONFIG = _frozen(dict(amax_block_k=64, amax_block_m=256, amax_chunk_m=256, amax_warps=4, cast_block_m=64,
                     cast_block_k=128, cast_warps=4))


#: Tiles of the row-wise (last-dim) kernel: rows of up to ``one_tile_max_k`` elements are read once (whole rows in
#: registers, ``one_tile_elems`` elements or one row per program, at most ``one_tile_rows`` rows, ``one_tile_warps``
#: warps); wider ones twice (``block_m`` x ``block_k`` tiles, the second read mostly from L2). Chosen from an A/B of
#: candidates on H100 (8192 rows, bf16); ``benchmarks/linear.py --quant`` measures the result ("Quantization kernels"
#: in docs/benchmarks.md). FSDP2's pre-all-gather of a parameter group (``_row_quant_group_kernel``, rows of several
#: widths in one launch) takes ``group_block_m`` x ``group_block_k`` tiles, two reads.
ROW_CONFIG = _frozen(dict(block_m=1, block_k=4096, warps=8, one_tile_max_k=8192, one_tile_elems=4096,
                          one_tile_rows=16, one_tile_warps=8, group_block_m=4, group_block_k=1024, group_warps=8))
_ROW_PLANS: dict = {}
#: (K, fp8 dtype, scale floor, multipliers, groups) -> the row kernel's constexprs (:func:`quantize_last_dim`).
_ROW_CONSTS: dict = {}


def _row_plan(K: int) -> tuple:
    """``(BLOCK_M, BLOCK_K, warps, ONE_TILE)`` of the row-wise kernel for rows of ``K`` elements (memoized)."""
    plan = _ROW_PLANS.get(K)
    if plan is None:
        c = ROW_CONFIG
        if K <= c["one_tile_max_k"]:
            bk = _next_power_of_2(max(K, 16))
            plan = (max(1, min(c["one_tile_rows"], c["one_tile_elems"] // bk)), bk, c["one_tile_warps"], True)
        else:
            plan = (c["block_m"], c["block_k"], c["warps"], False)
        if len(_ROW_PLANS) < 4096:
            _ROW_PLANS[K] = plan
    return plan


def row_kernel_available(x: torch.Tensor) -> bool:
    """Whether :func:`quantize_last_dim` takes ``x``: a contiguous CUDA fp32/bf16/fp16 tensor with an element, not
    requiring grad, that :func:`eager_launch_ok` (under ``torch.compile`` inductor fuses the plain ops instead)."""
    return (_HAS_TRITON and x.dtype in _KERNEL_DTYPES and x.is_cuda and x.dim() >= 1 and x.numel() > 0
            and x.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled()) and eager_launch_ok(x))


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # (types of tensors a kernel may take as they are)


def eager_launch_ok(x: torch.Tensor) -> bool:
    """Whether a kernel may be launched on ``x`` now from Python: a plain tensor (not a subclass, fake, or vmap/grad
    wrapper), nothing traced, no dispatch mode. Otherwise callers go through ops the tracer or mode sees."""
    return (
        not compat.is_compiling()  # first: dynamo cannot trace the C calls below (it would break the graph)
        and type(x) in PLAIN_TYPES
        and not compat.dispatch_modes_active()
        and not compat.is_functorch_wrapped(x)  # vmap / grad wrappers look like plain tensors
    )


def quantize_last_dim(x: torch.Tensor, float8_dtype: torch.dtype, scale_floor: float, *, checked: bool = False,
                      col_scale: Optional[torch.Tensor] = None,
                      col_scale_ends: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise quantization along the last dim in one Triton kernel (eager CUDA; see :func:`row_kernel_available`).

    ``scale = max(amax / fmax, scale_floor)``: the bits of the eager ``quantize_rowwise(x, -1, float8_dtype)`` (a NaN
    row gets an infinite scale), reading ``x`` twice. ``col_scale`` (``K`` contiguous float32 values on ``x``'s
    device): quantizes ``x.float() * col_scale`` instead. With ``col_scale_ends`` (int32 ``(G,)`` cumulative ends of
    token groups of ``x``'s rows, ``G >= 1``), ``col_scale`` is ``(G, K)`` contiguous float32 and row ``m`` is
    multiplied by the row of its group (``searchsorted(ends, m, right=True)``, at most ``G - 1``). Returns ``qdata``
    (``x``'s shape, ``float8_dtype``) and ``scale`` (float32 ``(*x.shape[:-1], 1)``).

    Raises:
        ValueError: ``x`` is not a tensor the kernel takes (check :func:`row_kernel_available` first), or
            ``col_scale`` / ``col_scale_ends`` are not as above.
    """
    if not checked and not row_kernel_available(x):  # checked=True: the caller just asked row_kernel_available
        raise ValueError("fp8tensor quantize_last_dim: needs a contiguous fp32/bf16/fp16 CUDA tensor in eager mode")
    K = x.shape[-1]
    M = x.numel() // K
    G = 0 if col_scale_ends is None else col_scale_ends.numel()
    if col_scale_ends is not None and not (
            col_scale_ends.dtype == torch.int32 and col_scale_ends.dim() == 1 and G >= 1
            and col_scale_ends.is_contiguous() and col_scale_ends.device == x.device and col_scale is not None):
        raise ValueError(f"fp8tensor quantize_last_dim: col_scale_ends must be a non-empty contiguous 1-D int32 tensor "
                         f"on {x.device}, with col_scale")
    if col_scale is not None and not (col_scale.dtype == torch.float32 and col_scale.numel() == max(G, 1) * K
                                      and col_scale.is_contiguous() and col_scale.device == x.device):
        raise ValueError(f"fp8tensor quantize_last_dim: col_scale must be {max(G, 1)} x {K} contiguous float32 values "
                         f"on {x.device}")
    q = torch.empty(x.shape, dtype=float8_dtype, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    bm, bk, warps, one_tile = _row_plan(K)
    has_c = col_scale is not None
    key = (K, float8_dtype, scale_floor, has_c, G)
    consts = _ROW_CONSTS.get(key)
    if consts is None:  # (one immutable mapping per key: the eager launcher reads its launch-key part once)
        consts = LaunchConsts(dict(FMAX=_fmax(float8_dtype), EPS=scale_floor, BLOCK_M=bm, BLOCK_K=bk, HAS_C=has_c,
                                   G_BLOCK=_next_power_of_2(G) if G else 0, ONE_TILE=one_tile))
        if len(_ROW_CONSTS) >= 4096:
            _ROW_CONSTS.clear()
        _ROW_CONSTS[key] = consts
    _launcher(_row_quant_kernel)(
        (_cdiv(M, bm),),
        (x, col_scale if has_c else x, q, scale, M, K, x if col_scale_ends is None else col_scale_ends, G),
        consts, warps, x.device)
    return q, scale


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
            torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}[dtype]


def quantize_last_dim_group(xs: list, float8_dtype: torch.dtype, scale_floor: float) -> list:
    """:func:`quantize_last_dim` of several tensors in one launch (same bits as one launch each).

    ``xs``: tensors for which :func:`row_kernel_available` holds, all of one dtype on one device. Returns one
    ``(qdata, scale)`` per tensor, views of two flat buffers (one fp8, one float32): FSDP2's pre-all-gather of a
    parameter group.

    Raises:
        ValueError: the tensors differ in dtype or device.
    """
    x0 = xs[0]
    if any(x.dtype != x0.dtype or x.device != x0.device for x in xs):
        raise ValueError("fp8tensor quantize_last_dim_group: tensors must share dtype and device")
    Ms = [x.numel() // x.shape[-1] for x in xs]
    q_flat = torch.empty(sum(x.numel() for x in xs), dtype=float8_dtype, device=x0.device)
    s_flat = torch.empty(sum(Ms), dtype=torch.float32, device=x0.device)
    out, qo, so = [], 0, 0
    for x, m in zip(xs, Ms):
        out.append((q_flat[qo:qo + x.numel()].view(x.shape), s_flat[so:so + m].view(*x.shape[:-1], 1)))
        qo += x.numel()
        so += m
    _launch_group(xs, [q.data_ptr() for q, _ in out], [s.data_ptr() for _, s in out], float8_dtype, scale_floor)
    return out


def quantize_last_dim_group_into(xs: list, q_ptrs: list, s_ptrs: list, float8_dtype: torch.dtype,
                                 scale_floor: float) -> None:
    """:func:`quantize_last_dim_group` writing to raw device addresses: ``xs[i]`` quantized row-wise into the fp8
    bytes at ``q_ptrs[i]`` (``xs[i].numel()`` bytes, row-major) and the float32 scales at ``s_ptrs[i]`` (one per row,
    4-byte aligned), buffers the caller owns (FSDP2's packed 1-rank payload).

    Raises:
        ValueError: the tensors differ in dtype or device, or a scale address is not 4-byte aligned.
    """
    x0 = xs[0]
    if any(x.dtype != x0.dtype or x.device != x0.device for x in xs) or any(p % 4 for p in s_ptrs):
        raise ValueError("fp8tensor quantize_last_dim_group_into: tensors must share dtype and device, scales must "
                         "be 4-byte aligned")
    _launch_group(xs, q_ptrs, s_ptrs, float8_dtype, scale_floor)


def _launch_group(xs: list, q_ptrs: list, s_ptrs: list, float8_dtype: torch.dtype, scale_floor: float) -> None:
    x0 = xs[0]
    c = ROW_CONFIG
    n = len(xs)
    Ks = [x.shape[-1] for x in xs]
    Ms = [x.numel() // k for x, k in zip(xs, Ks)]
    firsts = []
    blocks = 0
    bm = c["group_block_m"]
    for m in Ms:
        firsts.append(blocks)
        blocks += -(-m // bm)
    x_ptrs = [x.data_ptr() for x in xs]
    aligned = all(k % 16 == 0 for k in Ks) and all(p % 16 == 0 for p in x_ptrs + q_ptrs)
    table = _device_table(x_ptrs + q_ptrs + s_ptrs + Ms + Ks + firsts, x0.device)
    _launcher(_row_quant_group_kernel)(
        (blocks,), (table,),
        dict(N_T=n, FMAX=_fmax(float8_dtype), EPS=scale_floor, X_TY=_tl_dtype(x0.dtype),
             Q_TY=_tl_dtype(float8_dtype), BLOCK_M=bm, BLOCK_K=c["group_block_k"], ALIGNED=aligned),
        c["group_warps"], x0.device)


#: Device copies of the group kernel's argument tables, by content: FSDP2 quantizes the same group into buffers at
#: the same addresses step after step, so the table is built and copied to the device once, not every step.
_TABLES: dict = {}


#: Pinned host tables read at every replay by CUDA graphs captured outside ``graph_step``, whose end fp8tensor cannot
#: see: they live as long as the process (one per content). ``graph_step`` keeps its own with the graph.
_CAPTURED_TABLES: dict = {}


def _pinned_table(values: list) -> torch.Tensor:
    """``values`` as an int64 tensor in pinned host memory (the source of an asynchronous host-to-device copy)."""
    return torch.tensor(values, dtype=torch.int64).pin_memory()


def _captured_host_table(values: list) -> torch.Tensor:
    """The pinned host buffer a CUDA-graph capture copies a table from (read on every replay): kept with a
    ``graph_step`` graph, else the process-wide one of the same content (:data:`_CAPTURED_TABLES`)."""
    buf = _pinned_table(values)
    if capture.keep_for_replays(buf):
        return buf
    return _CAPTURED_TABLES.setdefault(tuple(values), buf)


def _device_table(values: list, device: torch.device) -> torch.Tensor:
    # Cached per stream: a table is only read on the stream that filled it (ordered after its copy).
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        return _captured_host_table(values).to(device, non_blocking=True)  # a copy node reading it at each replay
    key = (idx, compat.raw_cuda_stream(idx), tuple(values))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= 256:  # addresses that keep changing: keep the cache small
            _TABLES.clear()
        table = _TABLES[key] = _pinned_table(values).to(device, non_blocking=True)  # no host sync
    return table


def kernel_available(x: torch.Tensor) -> bool:
    """Whether the dim-0 kernels take ``x``: CUDA, fp32/bf16/fp16, at least one element, and either 2-D with unit
    inner stride (any row stride) or N-D contiguous (read as ``(numel / K, K)``)."""
    return _dim0_layout_ok(x) and _grid_ok(x, CONFIG["amax_chunk_m"], CONFIG["cast_block_k"])


def both_kernels_available(x: torch.Tensor) -> bool:
    """Whether :func:`launch_both` (the two-layout kernels) takes ``x``: as :func:`kernel_available`, within the
    two-layout kernels' grids."""
    return _dim0_layout_ok(x) and _grid_ok(x, BOTH_CONFIG["amax_chunk_m"], BOTH_CONFIG["cast_block_k"])


def _dim0_layout_ok(x: torch.Tensor) -> bool:
    return (_HAS_TRITON and x.is_cuda and x.dtype in _KERNEL_DTYPES and x.numel() > 0
            and ((x.dim() == 2 and x.stride(1) == 1) or (x.dim() > 2 and x.is_contiguous())))


def _grid_ok(x: torch.Tensor, rows_per_program: int, cols_per_program: int) -> bool:
    # The kernels index with 32-bit offsets (the elements x spans and the M * K of their outputs: rows of a 2-D x may
    # overlap); the grid's second dim (at most 65535) holds M / rows_per_program (the amax kernels: their fewest rows
    # per program) and K / cols_per_program (the casts).
    K = x.shape[-1]
    M = x.numel() // K
    rows = x.stride(0) * (M - 1) + K if x.dim() == 2 else x.numel()  # elements spanned
    return (rows < 2**31 and x.numel() < 2**31 and M <= 65535 * rows_per_program
            and K <= 65535 * cols_per_program)


def launch_dim0_t(x: torch.Tensor, float8_dtype: torch.dtype, scale_floor: float, *, traced: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the dim-0 kernels on ``x`` ``(M, K)`` (check :func:`kernel_available` first; an N-D contiguous ``x``
    ``(..., K)`` is read as ``(numel / K, K)`` without a reshape): ``(q, scale)``, ``q`` ``(K, M)`` row-major
    ``float8_dtype`` holding ``x.T`` quantized row-wise, ``scale`` ``(K, 1)`` float32.
    ``scale_floor``: the smallest scale, ``max(amax / fmax, floor)``. Tiles from :data:`CONFIG` (read at each call).

    ``traced=True``: the body of the ``triton_op`` ``fp8tensor::quantize_dim0_t`` (``wrap_triton``), with ``x``
    realized once (:func:`fp8tensor.compat.one_buffer`), else an eager launch."""
    if traced:  # both kernels read one buffer of x (else inductor writes a fused x out once per kernel)
        x = compat.one_buffer(x)
    K = x.shape[-1]
    M = x.numel() // K
    stride_m = x.stride(0) if x.dim() == 2 else K
    amax = torch.zeros(K, dtype=torch.float32, device=x.device)
    q = torch.empty(K, M, dtype=float8_dtype, device=x.device)
    scale = torch.empty(K, 1, dtype=torch.float32, device=x.device)
    c = CONFIG
    _launch(_col_amax_kernel, (_cdiv(K, c["amax_block_k"]), _cdiv(M, c["amax_chunk_m"])),
            (x, amax, M, K, stride_m), dict(CHUNK_M=c["amax_chunk_m"], BLOCK_M=c["amax_block_m"],
                                            BLOCK_K=c["amax_block_k"]), c["amax_warps"], x.device, traced=traced)
    _launch(_cast_t_kernel, (_cdiv(M, c["cast_block_m"]), _cdiv(K, c["cast_block_k"])),
            (x, amax, q, scale, M, K, stride_m), dict(FMAX=_fmax(float8_dtype), EPS=scale_floor,
                                                      BLOCK_M=c["cast_block_m"], BLOCK_K=c["cast_block_k"]),
            c["cast_warps"], x.device, traced=traced)
    return q, scale


#: Tiles of the two-layout kernels (:func:`launch_both`).
#: The amax kernel's rows per program, a power of two from amax_chunk_m to amax_chunk_m_max, is picked for about
#: amax_programs programs (measured on an H200 at 8192 tokens: 128 rows at K = 2048, 256 at 4096, 512 from 8192).
BOTH_CONFIG = _frozen(dict(amax_block_m=32, amax_block_k=256, amax_chunk_m=128, amax_chunk_m_max=512,
                          amax_programs=512, amax_warps=4, cast_block_m=64, cast_block_k=128, cast_warps=4))


def launch_both(x: torch.Tensor, float8_dtype: torch.dtype, scale_floor: float, *, traced: bool = False) -> tuple:
    """``x`` ``(M, K)`` (as :func:`launch_dim0_t` takes it) quantized per row and per column from two reads: the
    row and column amax in one pass, then both layouts from one read of each tile. Returns ``(q, s, qt, st)``: ``q``
    ``(M, K)`` row-major with ``s`` ``(M, 1)`` (per row), ``qt`` ``(K, M)`` row-major holding ``x.T`` per row with
    ``st`` ``(K, 1)``; float32 scales ``max(amax / fmax, scale_floor)``; ``x`` times the scale's reciprocal (within
    an fp32 ulp of ``x / scale``: an fp8 value differs from the ops' only at or next to a rounding tie)."""
    if traced:
        x = compat.one_buffer(x)
    K = x.shape[-1]
    M = x.numel() // K
    stride_m = x.stride(0) if x.dim() == 2 else K
    amax = torch.zeros(M + K, dtype=torch.float32, device=x.device)
    q = torch.empty(M, K, dtype=float8_dtype, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    qt = torch.empty(K, M, dtype=float8_dtype, device=x.device)
    st = torch.empty(K, 1, dtype=torch.float32, device=x.device)
    c = BOTH_CONFIG
    col_blocks = _cdiv(K, c["amax_block_k"])
    chunk = c["amax_chunk_m"]
    if isinstance(M, int) and isinstance(K, int):  # (symbolic sizes: the fixed chunk, no guard on the token count)
        chunk = min(c["amax_chunk_m_max"], max(chunk, _next_power_of_2(_cdiv(M * col_blocks,
                                                                                         c["amax_programs"]))))
    _launch(_amax_both_kernel, (col_blocks, _cdiv(M, chunk)),
            (x, amax, M, K, stride_m), dict(CHUNK_M=chunk, BLOCK_M=c["amax_block_m"],
                                            BLOCK_K=c["amax_block_k"]), c["amax_warps"], x.device, traced=traced)
    _launch(_cast_both_kernel, (_cdiv(M, c["cast_block_m"]), _cdiv(K, c["cast_block_k"])),
            (x, amax[:M], amax[M:], q, s, qt, st, M, K, stride_m),
            dict(FMAX=_fmax(float8_dtype), EPS=scale_floor, BLOCK_M=c["cast_block_m"],
                 BLOCK_K=c["cast_block_k"]), c["cast_warps"], x.device, traced=traced)
    return q, s, qt, st


#: Tiles of the transpose kernel (1-byte elements).
TRANSPOSE_CONFIG = _frozen(dict(block_m=128, block_n=128, warps=8))


def transpose_available(src: torch.Tensor) -> bool:
    """Whether :func:`launch_transpose` takes ``src``: a 2-D ``(M, N)`` or 3-D ``(B, M, N)`` CUDA tensor of 1-byte
    elements (fp8) with unit inner stride and at least one element."""
    nd = src.dim()
    return (_HAS_TRITON and src.is_cuda and nd in (2, 3) and src.element_size() == 1 and src.stride(-1) == 1
            and src.numel() > 0 and src.shape[-1] <= 65535 * TRANSPOSE_CONFIG["block_n"]  # (the grid's second dim)
            and (nd == 2 or src.shape[0] <= 65535))  # (the third)


def launch_transpose(src: torch.Tensor) -> torch.Tensor:
    """``src.transpose(-2, -1).contiguous()`` for an fp8 ``src`` ``(M, N)`` or ``(B, M, N)`` (check
    :func:`transpose_available`) in one tiled Triton kernel: ``(N, M)`` / ``(B, N, M)`` row-major, same dtype
    (≈0.04 ms for a 14336×4096 fp8 weight on H200, against ≈0.2 ms for ATen's strided copy). An eager launch."""
    B = src.shape[0] if src.dim() == 3 else 1
    M, N = src.shape[-2:]
    dst = torch.empty((*src.shape[:-2], N, M), dtype=src.dtype, device=src.device)
    c = TRANSPOSE_CONFIG
    grid = (_cdiv(M, c["block_m"]), _cdiv(N, c["block_n"]), B)
    _launcher(_transpose_kernel)(grid, (src, dst, M, N, src.stride(-2), src.stride(0) if B > 1 else 0),
                                 dict(BLOCK_M=c["block_m"], BLOCK_N=c["block_n"]), c["warps"], src.device)
    return dst


#: Tiles of :func:`launch_cast_rows_t` (any tile gives the same bits).
CAST_ROWS_T_CONFIG = _frozen(dict(block_m=64, block_n=128, warps=8))


def cast_rows_t_available(src: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether :func:`launch_cast_rows_t` takes ``src`` and ``scale`` now, launched from Python: a 2-D ``(M, N)`` or
    3-D ``(B, M, N)`` float32/bf16/fp16 CUDA ``src`` with unit inner stride and at least one element (``N`` at most
    65535 column tiles, ``B`` at most 65535, ``M * N`` below 2^31), a contiguous float32 ``scale`` of
    ``src.shape[:-1]`` on its device, in eager mode (no tracing, no dispatch mode, plain tensors, no autograd
    recording)."""
    nd = src.dim()
    c = CAST_ROWS_T_CONFIG
    return (_HAS_TRITON and src.is_cuda and nd in (2, 3) and src.dtype in _KERNEL_DTYPES and src.stride(-1) == 1
            and src.numel() > 0 and src.shape[-1] <= 65535 * c["block_n"] and (nd == 2 or src.shape[0] <= 65535)
            and src.shape[-2] * src.shape[-1] < 2**31
            and scale.dtype == torch.float32 and tuple(scale.shape) == tuple(src.shape[:-1])
            and scale.is_contiguous() and scale.device == src.device
            and eager_launch_ok(src) and eager_launch_ok(scale)
            and not (torch.is_grad_enabled() and (src.requires_grad or scale.requires_grad)))


def launch_cast_rows_t(src: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """The rows of ``src`` ``(M, N)`` / ``(B, M, N)`` divided by their float32 ``scale`` ``(M,)`` / ``(B, M)``,
    saturated to ``float8_dtype``'s range and stored transposed: ``(N, M)`` / ``(B, N, M)`` row-major, in one tiled
    Triton kernel (check :func:`cast_rows_t_available`). The row kernel's arithmetic (``x / scale`` as an IEEE
    division, then the clamp and the cast): with the scales the row kernel computed, the bits of its output,
    transposed. An eager launch (off CUDA: Triton's interpreter)."""
    B = src.shape[0] if src.dim() == 3 else 1
    M, N = src.shape[-2:]
    dst = torch.empty((*src.shape[:-2], N, M), dtype=float8_dtype, device=src.device)
    c = CAST_ROWS_T_CONFIG
    grid = (_cdiv(M, c["block_m"]), _cdiv(N, c["block_n"]), B)
    _launch(_cast_rows_t_kernel, grid, (src, scale, dst, M, N, src.stride(-2), src.stride(0) if B > 1 else 0),
            dict(FMAX=_fmax(float8_dtype), BLOCK_M=c["block_m"], BLOCK_N=c["block_n"]), c["warps"], src.device)
    return dst


#: Tiles of the per-group column quantization (the same bits for any, in either form). One launch, a program per
#: (column strip, group) reading its group twice: 128 x 16 tiles, the fastest of six candidates in an A/B on H100 at
#: 16384 tokens over 8 groups (C = 768-7168) and 65536 over 128 (C = 768, 2048). Split form (mode "auto": groups of
#: ``split_min_rows`` rows or more on average; "split" / "one_kernel" force a form): each group's rows in
#: ``min(split_max, rows // split_rows)`` chunks, an amax launch (``amax_*`` tiles; atomic max per chunk) then a cast
#: launch (``block_m`` x ``block_c``). ``python benchmarks/moe.py --quant`` times both forms per MoE operand
#: (docs/benchmarks.md, record moe_col_quant_h100: on H100 the split took 86.2 against 121.2 µs at 16384 x 2048
#: over 8 groups).
GROUP_COL_CONFIG = _frozen(dict(block_m=128, block_c=16, warps=4, mode="auto", split_min_rows=1024, split_rows=512,
                                split_max=8, amax_block_m=128, amax_block_c=64, amax_warps=4))


def group_col_chunks(M: int, G: int) -> int:
    """How many chunks :func:`launch_group_cols_t` splits each group's rows into for ``M`` rows over ``G`` groups
    (1: the one-launch kernel), from :data:`GROUP_COL_CONFIG` and the shapes alone (no device value read)."""
    c = GROUP_COL_CONFIG
    rows = M // max(G, 1)
    if c["mode"] == "one_kernel":
        return 1
    if c["mode"] == "split":
        return max(2, min(c["split_max"], rows // c["split_rows"]))
    return max(1, min(c["split_max"], rows // c["split_rows"])) if rows >= c["split_min_rows"] else 1


def group_col_layout_ok(x: torch.Tensor) -> bool:
    """Whether the per-group column kernel can read ``x`` (traced or not): a 2-D fp32/bf16/fp16 CUDA tensor with unit
    column stride, below 2^31 elements."""
    return (_HAS_TRITON and x.is_cuda and x.dim() == 2 and x.dtype in _KERNEL_DTYPES
            and (x.stride(1) == 1 or x.shape[1] <= 1) and x.numel() < 2**31)


def group_col_kernel_available(x: torch.Tensor) -> bool:
    """Whether :func:`launch_group_cols_t` takes ``x`` now, launched from Python: :func:`group_col_layout_ok`, in
    eager mode (no tracing, no dispatch mode, a plain tensor)."""
    return (group_col_layout_ok(x) and eager_launch_ok(x)
            and not (x.requires_grad and torch.is_grad_enabled()))


def launch_group_cols_t(x: torch.Tensor, ends: torch.Tensor, dst: torch.Tensor, q: torch.Tensor,
                        scale: torch.Tensor, *, stride_qg: int, stride_qc: int, q_cols: int, align: int,
                        float8_dtype: torch.dtype, scale_floor: float, min_pad: int = 0,
                        traced: bool = False) -> None:
    """Per-group column quantization of ``x`` ``(M, C)`` written transposed into ``q`` (check
    :func:`group_col_kernel_available` first).

    Group ``g`` holds rows ``[ends[g-1], ends[g])`` (``ends`` int32 ``(G,)``, cumulative; ``ends[-1]`` of 0 for
    ``g == 0``). Its column scales ``max(amax / fmax, scale_floor)`` go to ``scale[g, c]`` (float32 ``(G, C)``,
    contiguous) and its ``r``-th row, quantized, to ``q.flat[g * stride_qg + c * stride_qc + dst[g] + r]`` for
    ``r < max(round_up(size, align), min_pad)`` (zeros past the group's rows) and ``dst[g] + r < q_cols``. Two reads
    of ``x``: one for the amax, one for the cast; one launch, or, for large groups (:func:`group_col_chunks`), an
    amax launch and a cast launch over chunks of each group's rows (the same bits). ``traced=True``: the body of a
    ``triton_op`` (``wrap_triton``; ``x`` realized once, :func:`fp8tensor.compat.one_buffer`)."""
    if traced:
        x = compat.one_buffer(x)
    M, C = x.shape
    G = ends.numel()
    if G == 0 or C == 0:
        return
    c = GROUP_COL_CONFIG
    consts = dict(ALIGN=align, MIN_PAD=min_pad, BLOCK_M=c["block_m"], BLOCK_C=c["block_c"])
    S = group_col_chunks(M, G)
    if S == 1:
        _launch(_group_col_quant_t_kernel, (_cdiv(C, c["block_c"]), G),
                (x, ends, dst, q, scale, M, C, x.stride(0), stride_qg, stride_qc, q_cols),
                dict(FMAX=_fmax(float8_dtype), EPS=scale_floor, **consts), c["warps"], x.device, traced=traced)
        return
    amax = torch.zeros(G, C, dtype=torch.float32, device=x.device)
    _launch(_group_col_amax_kernel, (_cdiv(C, c["amax_block_c"]), S, G), (x, ends, amax, M, C, x.stride(0), S),
            dict(ALIGN=align, MIN_PAD=min_pad, BLOCK_M=c["amax_block_m"], BLOCK_C=c["amax_block_c"]),
            c["amax_warps"], x.device, traced=traced)
    _launch(_group_col_cast_t_kernel, (_cdiv(C, c["block_c"]), S, G),
            (x, ends, dst, amax, q, scale, M, C, x.stride(0), stride_qg, stride_qc, q_cols, S),
            dict(FMAX=_fmax(float8_dtype), EPS=scale_floor, **consts), c["warps"], x.device, traced=traced)


# ------------------------------------------------------------------------------ small-M fp8-weight GEMM (decode)
if _HAS_TRITON:

    @triton.jit
    def _w8_mm_slice(x_ptr, w_ptr, rm, rn, rk, k_start, M, N, K, K_PER, stride_xm, stride_wn,
                     X_TY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     N_MAJOR: tl.constexpr, X_FP8: tl.constexpr, SWAP_AB: tl.constexpr, GEMV: tl.constexpr):
        # The float32 partial sum (BLOCK_M, BLOCK_N) of x @ w.T over K slice [k_start, k_start + K_PER), unscaled.
        if GEMV:  # one row (BLOCK_M 1), no MMA: each weight tile widened to fp32 times x's vector, summed over K
            tl.static_assert(BLOCK_M == 1, "a gemv tile takes one row")
            acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for kk in range(0, K_PER, BLOCK_K):
                k = k_start + kk + rk
                w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K),
                            other=0.0).to(tl.float32)
                xv = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                acc1 += tl.sum(w * xv[None, :], axis=1)
            acc = acc1[None, :]
        elif SWAP_AB:
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for kk in range(0, K_PER, BLOCK_K):
                k = k_start + kk + rk
                w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K),
                            other=0.0)
                xt = tl.load(x_ptr + rm[None, :] * stride_xm + k[:, None], mask=(rm[None, :] < M) & (k[:, None] < K),
                             other=0.0)
                if X_FP8:
                    acc_t += tl.dot(w, xt)
                else:
                    acc_t += tl.dot(w.to(X_TY), xt.to(X_TY))
            acc = tl.trans(acc_t)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, K_PER, BLOCK_K):
                k = k_start + kk + rk
                x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K),
                            other=0.0)
                if N_MAJOR:  # the weight tile loaded (BLOCK_N, BLOCK_K), K contiguous, and transposed in registers
                    w = tl.trans(tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :],
                                         mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0))
                else:
                    w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None],
                                mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
                if X_FP8:
                    acc += tl.dot(x, w)
                else:
                    acc += tl.dot(x.to(X_TY), w.to(X_TY))
        return acc

    @triton.jit
    def _w8_mm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, o_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_om,
                      stride_os, xs_ptr, HAS_BIAS: tl.constexpr, FINAL: tl.constexpr, X_TY: tl.constexpr,
                      O_TY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      N_MAJOR: tl.constexpr = False, X_FP8: tl.constexpr = False,
                      SWAP_AB: tl.constexpr = False, ONE_LAUNCH: tl.constexpr = False, GEMV: tl.constexpr = False):
        # Program (n, s): output columns [n * BLOCK_N, ...) over the K slice s, all M rows; the fp8 weight widened
        # to x's dtype (exact) with fp32 accumulation (GEMV, one row: no MMA, the weight tile widened to fp32
        # times x's vector). X_FP8: x is fp8 too (row scales xs), the dot fp8 x fp8 with
        # fp32 accumulation. FINAL: the row scales of an fp8 x, then the weight's scales (and bias) applied and
        # stored, else the unscaled fp32 partial sum goes to slice s of the workspace (the reduce kernel applies the
        # scales after the sum, in the same order). SWAP_AB: the product taken as w @ x.T, the weight tile the MMA's
        # row side and the tokens its column side, the (BLOCK_N, BLOCK_M) result transposed in registers for the
        # same epilogue. ONE_LAUNCH (with FINAL; grid (n, 1)): the program computes every K slice of K_PER in turn
        # and adds their partial sums in slice order, from zero, as the reduce kernel does (plain adds, nothing to
        # fuse into a multiply-add): the same bits as the split and its reduce launch, in one launch.
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        if ONE_LAUNCH:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ks in range(0, K, K_PER):
                acc += _w8_mm_slice(x_ptr, w_ptr, rm, rn, rk, ks, M, N, K, K_PER, stride_xm, stride_wn,
                                    X_TY, BLOCK_M, BLOCK_N, BLOCK_K, N_MAJOR, X_FP8, SWAP_AB, GEMV)
        else:
            acc = _w8_mm_slice(x_ptr, w_ptr, rm, rn, rk, pid_s * K_PER, M, N, K, K_PER, stride_xm, stride_wn,
                               X_TY, BLOCK_M, BLOCK_N, BLOCK_K, N_MAJOR, X_FP8, SWAP_AB, GEMV)
        omask = (rm[:, None] < M) & (rn[None, :] < N)
        if FINAL:
            if X_FP8:
                acc = acc * tl.load(xs_ptr + rm, mask=rm < M, other=0.0)[:, None]
            s = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
            acc = acc * s[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(o_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(O_TY), mask=omask)
        else:
            tl.store(o_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=omask)

    @triton.jit
    def _w8_mm_reduce_kernel(ws_ptr, s_ptr, b_ptr, o_ptr, MN, N, xs_ptr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                             O_TY: tl.constexpr, BLOCK: tl.constexpr, X_FP8: tl.constexpr = False):
        # out = (sum over the SPLIT partial sums) (* xs[m]) * scale[n] (+ bias[n]), fixed summation order:
        # deterministic
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
        if X_FP8:
            acc = acc * tl.load(xs_ptr + offs // N, mask=mask, other=0.0)
        n = offs % N
        acc = acc * tl.load(s_ptr + n, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + offs, acc.to(O_TY), mask=mask)


#: Tiles of the small-M fp8-weight GEMM, per row block (1, 16, 32, 64 or 128 rows; a block takes the token counts
#: above the next smaller one): weight tiles (``n_major``: loaded K-contiguous, transposed in registers; ``swap_ab``:
#: the product taken as ``w8 @ x.T``, the weight tile on the MMA's row side and the tokens on its column side;
#: ``gemv``, one row only: no MMA, each weight tile widened to float32 and multiplied by x's vector, summed over the
#: tile's K); K is split until about ``programs_per_sm`` programs per SM stream the
#: weight (slices of at least ``min_k_tiles`` tiles), partials summed in fixed order by a second launch
#: (``reduce_block`` elements per program).
#:
#: The no-grad Linear's decode route (:func:`fp8tensor.quantize.decode_mm`): up to ``max_m`` tokens ``x`` in its own
#: precision times the widened fp8 weight (weight-only: the step reads the weight's bytes, and ``x`` is not rounded);
#: from ``max_m + 1`` to ``max_m_fp8x`` tokens ``x`` quantized per row to e4m3 and the dot fp8 x fp8 (twice the
#: MMA rate and half of ``x``'s bytes per weight tile). Both split K where cuBLAS's row-scaled fp8 GEMM has no split
#: for small M. Measured on H100 (GPU µs per GEMM, partial sums only, Llama3-8B shapes wq / wk / w1 / w2): at 16
#: tokens weight-only 9.5 / 4.4 / 24.8 / 26.3 against fp8 x 7.9-8.3 / 3.9-4.1 / 24.0-24.1 / 23.3-23.7 (level, and
#: weight-only does not round x); at 32 tokens 10.9 / 5.8 / 36.0 / 33.6 against 8.6 / 4.3 / 26.6 / 25.2; at 64
#: tokens 13.0 / 6.0 / 47.5 / 41.5 against 11.9 / 4.6 / 30.8 / 28.1 (cuBLAS's dual fp8: 15.9 / 15.4 / 29.6 / 45.8).
#: Tiles of 16 rows tuned on H200 over Llama3-8B shapes (sweep at commit b44f11a); 32 rows (the fp8 x form): the
#: fastest over a layer of nine candidates on H100. 64 rows: one program per SM before the K split (programs_per_sm
#: 1, slices of at least 4 tiles), from a sweep of 60 kernels x 7 grids on H100 at 64 tokens: w1 / w3 then run
#: unsplit (224 column blocks), 24.4 µs against 29.8 with three slices, and a layer's GEMMs (partial sums, as in a
#: compiled graph) take about 100 µs against 118.6 (best per shape 98.7). 128 not tuned. One row (one token): the
#: gemv tile, from a sweep of 362 gemv tiles and grids on H100 (torch 2.11; docs/results/decode_gemv_sweep_h100.json):
#: a layer's GEMMs (partial sums) take 90.4 µs against 102.9 with the 16-row MMA tile (bf16 180.2; the best gemv tile
#: per shape 88.8); w1 / w3 / w2 read at about 2.6 TB/s. gemv tiles of four and eight rows (a 3-D product) ran
#: 5-20 times slower than the MMA tile in the same sweep, so the kernel takes them for one row only.
W8_MM_CONFIG = _frozen(dict(max_m=16, max_m_fp8x=64, reduce_block=1024, tiles={
    1: dict(block_n=8, block_k=1024, warps=4, stages=1, programs_per_sm=4, min_k_tiles=1, gemv=True),
    16: dict(block_n=32, block_k=128, warps=4, stages=3, programs_per_sm=4, min_k_tiles=4, n_major=False),
    32: dict(block_n=64, block_k=128, warps=4, stages=3, programs_per_sm=4, min_k_tiles=4, swap_ab=True),
    64: dict(block_n=64, block_k=256, warps=4, stages=3, programs_per_sm=1, min_k_tiles=4, n_major=True),
    128: dict(block_n=64, block_k=64, warps=8, stages=3, programs_per_sm=2, min_k_tiles=8, n_major=True),
}))
assert W8_MM_CONFIG["max_m"] <= W8_MM_CONFIG["max_m_fp8x"] <= max(W8_MM_CONFIG["tiles"])
_SM_COUNT: dict = {}
_W8_PLANS: dict = {}


def w8_mm_available(x: torch.Tensor, w8: torch.Tensor) -> bool:
    """Whether the no-grad Linear's decode route takes ``x`` (bf16 / fp16; ``(M, K)`` with unit last stride, or
    ``(..., K)`` contiguous, ``1 <= M <= W8_MM_CONFIG["max_m_fp8x"]`` rows in all) and the fp8 weight ``w8``
    ``(N, K)`` (row-major) on one CUDA device, with Triton; fake tensors (compile) included. Past
    ``W8_MM_CONFIG["max_m"]`` rows the route quantizes ``x`` to the weight's dtype, which must then be e4m3."""
    nd = x.dim()
    if not (_HAS_TRITON and x.is_cuda and w8.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and w8.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and x.device == w8.device
            and (nd == 2 or (nd > 2 and x.is_contiguous()))):
        return False
    xs, ws = x.shape, w8.shape  # (the checks in their order; each read of .shape builds a torch.Size)
    M = xs[0] if nd == 2 else math.prod(xs[:-1])
    c = W8_MM_CONFIG
    return (1 <= M <= c["max_m"] or (1 <= M <= c["max_m_fp8x"] and w8.dtype == torch.float8_e4m3fn)) and (
            xs[-1] == ws[1] and ws[0] > 0 and (x.stride(-1) == 1 or xs[-1] <= 1) and (w8.stride(1) == 1 or ws[1] <= 1)
            and x.numel() < 2**31 and w8.numel() < 2**31)


def _w8_mm_bucket(M: int) -> int:
    """The row block of :data:`W8_MM_CONFIG`'s tile table that takes ``M`` rows: the smallest key ``>= M``.

    Raises:
        ValueError: ``M`` exceeds the largest row block."""
    for k in _W8_BUCKETS:
        if k >= M:
            return k
    raise ValueError(f"fp8tensor launch_w8_mm: {M} rows; the decode GEMM has tiles for at most {_W8_BUCKETS[-1]} "
                     "(W8_MM_CONFIG['tiles'])")


def _w8_mm_plan(M: int, N: int, K: int, device: torch.device, tiles=None) -> tuple:
    """``(BLOCK_M, tiles, grid, split, k_per)`` of :func:`launch_w8_mm` for an ``(M, K) x (N, K)^T`` product
    (``tiles``: one row block's tile dict instead of the table's, not cached)."""
    idx = (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else -1
    key = (idx, M, N, K)
    plan = _W8_PLANS.get(key) if tiles is None else None
    if plan is not None:
        return plan
    sms = _SM_COUNT.get(idx)
    if sms is None:
        sms = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count if idx >= 0 else 1
    c = W8_MM_CONFIG["tiles"][_w8_mm_bucket(M)] if tiles is None else tiles
    if c.get("gemv", False):
        if M > 1:
            raise ValueError(f"fp8tensor launch_w8_mm: a gemv tile (no MMA) takes one row; {M} rows")
        bm = 1
    else:
        bm = max(16, _next_power_of_2(M))
    nb, kt = _cdiv(N, c["block_n"]), _cdiv(K, c["block_k"])
    split = max(1, min(_cdiv(sms * c["programs_per_sm"], nb), kt // c["min_k_tiles"]))
    k_per = _cdiv(kt, split) * c["block_k"]
    split = _cdiv(K, k_per) if K else 1
    plan = (bm, c, (nb, split), split, k_per)
    if tiles is None:
        if len(_W8_PLANS) >= 4096:
            _W8_PLANS.clear()
        _W8_PLANS[key] = plan
    return plan


def w8_mm_split(M: int, N: int, K: int, device: torch.device) -> int:
    """How many K slices :func:`launch_w8_mm` splits an ``(M, K) x (N, K)^T`` product into (CUDA ``device``;
    1: its kernel writes the output, else its float32 partial sums are added by a second launch, by the same launch
    (``one_launch``), or in the traced graph: :func:`launch_w8_mm_partials`)."""
    return _w8_mm_plan(M, N, K, device)[3]


def launch_w8_mm_partials(x: torch.Tensor, w8: torch.Tensor, *, traced: bool = False, tiles=None) -> torch.Tensor:
    """The float32 partial sums ``(split, M, N)`` of :func:`launch_w8_mm`'s K split, unscaled: slice ``s`` is
    ``x[:, Ks] @ w8[:, Ks].T`` over the ``s``-th K slice (``split = w8_mm_split(M, N, K, x.device)``). Summed in slice
    order, times an fp8 ``x``'s row scales, times the weight's row scales (and plus the bias) in float32, then
    rounded to the output dtype, they give :func:`launch_w8_mm`'s output: what its reduce launch computes. The traced
    no-grad Linear sums them in the graph, where inductor fuses the sum, the scales and the bias into the output's
    consumer instead of a launch of their own.

    Args:
        x: ``(M, K)`` bf16 / fp16, or fp8 of ``w8``'s dtype (the dot fp8 x fp8), with unit last stride,
            ``1 <= M <= 128``. w8: ``(N, K)`` fp8, unit last stride.
        traced: the body of a ``triton_op`` (``wrap_triton``).
        tiles: one row block's tile dict instead of the table's (tile sweeps).

    Raises:
        ValueError: ``x`` not 2-D, ``M`` outside ``[1, 128]``, an fp8 ``x`` of another dtype than ``w8``, or
            ``split`` is 1 (call :func:`launch_w8_mm`).
    """
    if x.dim() != 2 or not 1 <= int(x.shape[0]) <= _W8_MAX_M:
        raise ValueError(f"fp8tensor launch_w8_mm_partials: x must be (M, K) with 1 <= M <= {_W8_MAX_M}; got shape "
                         f"{tuple(x.shape)}")
    M, K, N = int(x.shape[0]), int(x.shape[1]), int(w8.shape[0])
    x_fp8 = x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if x_fp8 and x.dtype != w8.dtype:
        raise ValueError(f"fp8tensor launch_w8_mm_partials: an fp8 x ({x.dtype}) needs the weight's fp8 dtype "
                         f"({w8.dtype})")
    grid, split, k_per, consts, warps, stages, _, _ = _w8_mm_launch(
        M, N, K, x.device, torch.float32 if x_fp8 else x.dtype, False, x_fp8, tiles)
    if split == 1:
        raise ValueError(f"fp8tensor launch_w8_mm_partials: ({M}, {K}) x ({N}, {K})^T is not split over K; call "
                         "launch_w8_mm")
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    args = (x, w8, ws, ws, ws, M, N, K, k_per, x.stride(0), w8.stride(0), N, M * N, ws)  # (s_ptr, b_ptr, xs_ptr unread)
    _launch(_w8_mm_kernel, grid, args, consts, warps, x.device, stages, traced=traced)
    return ws


def _w8_mm_launch(M: int, N: int, K: int, device: torch.device, dtype: torch.dtype, has_bias: bool, x_fp8: bool,
                  tiles=None, one_launch: bool = False) -> tuple:
    """What :func:`launch_w8_mm` passes its launches besides the tensors: ``(grid, launches' split, k_per, consts,
    warps, stages, reduce grid, reduce consts)``, a pure function of its arguments (memoized in ``_W8_LAUNCHES`` per
    device, shape, output dtype, bias, fp8 ``x`` and ``one_launch``: the eager call builds no dicts). ``one_launch``
    with a K split: one program per column block adds the slices itself (the same bits; the split given as 1, no
    workspace and no reduce launch)."""
    bm, c, grid, split, k_per = _w8_mm_plan(M, N, K, device, tiles)
    one = one_launch and split > 1
    if one:
        grid, split = (grid[0], 1), 1
    ty = _tl_dtype(dtype)
    consts = dict(HAS_BIAS=has_bias, FINAL=split == 1, X_TY=ty, O_TY=ty, BLOCK_M=bm, BLOCK_N=c["block_n"],
                  BLOCK_K=c["block_k"], N_MAJOR=c.get("n_major", False), X_FP8=x_fp8,
                  SWAP_AB=c.get("swap_ab", False), ONE_LAUNCH=one, GEMV=c.get("gemv", False))
    rblock = W8_MM_CONFIG["reduce_block"]
    rconsts = dict(SPLIT=split, HAS_BIAS=has_bias, O_TY=ty, BLOCK=rblock, X_FP8=x_fp8)
    return (grid, split, k_per, LaunchConsts(consts), c["warps"], c["stages"],
            ((M * N + rblock - 1) // rblock,), LaunchConsts(rconsts))


#: Memo of :func:`_w8_mm_launch` (bounded; a pure function of its key).
_W8_LAUNCHES: dict = {}
#: The eager launches' plans by ``(x.shape, N, x.dtype, device, bias or not, one launch, the output dtype for an fp8
#: x else None)``: ``(output shape, whether x is 2-D (else a contiguous ``(..., K)``), M, N, K, the
#: :func:`_w8_mm_launch` tuple)``, a pure function of the key (bounded). Filled by :func:`launch_w8_mm` after a call
#: of that key passed its checks (M, N >= 1), so a hit checks only what the key does not fix (a ``(..., K)`` x's
#: contiguity; for an fp8 x, its dtype against the weight's and ``x_scale``: float32, ``(M, 1)``, contiguous).
_W8_EAGER: dict = {}
#: The most rows of :func:`launch_w8_mm` (the largest row block of the frozen tile table).
_W8_MAX_M = W8_MAX_M = max(W8_MM_CONFIG["tiles"])
#: The row blocks of the tile table, ascending.
_W8_BUCKETS = tuple(sorted(W8_MM_CONFIG["tiles"]))


def _w8_mm_run(x, w8, scale, bias, x_scale, dtype, shape, two_d, M, N, K, launch) -> torch.Tensor:
    """The launches of :func:`launch_w8_mm` from a plan of :data:`_W8_EAGER` (``two_d``: whether ``x`` is 2-D;
    ``dtype``: the output's)."""
    dev = x.device
    out = torch.empty(shape, dtype=dtype, device=dev)
    grid, split, k_per, consts, warps, stages, rgrid, rconsts = launch
    b = scale if bias is None else bias
    xs = scale if x_scale is None else x_scale  # (scale (N, 1) and x_scale (M, 1) contiguous: read flat)
    ws = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=dev)
    args = (x, w8, scale, b, ws, M, N, K, k_per, x.stride(0) if two_d else K, w8.stride(0), N, M * N, xs)
    _launch(_w8_mm_kernel, grid, args, consts, warps, dev, stages)
    if split > 1:
        _launch(_w8_mm_reduce_kernel, rgrid, (ws, scale, b, out, M * N, N, xs), rconsts, 4, dev)
    return out


def launch_w8_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                 *, traced: bool = False, tiles=None, x_scale: Optional[torch.Tensor] = None,
                 out_dtype: torch.dtype = torch.bfloat16, one_launch: Optional[bool] = None) -> torch.Tensor:
    """``(x @ w8.T) * scale.T (+ bias)`` ``(M, N)`` in ``x``'s dtype, reading the fp8 weight ``w8`` ``(N, K)`` once.

    Args:
        x: ``(M, K)`` bf16 / fp16, unit last stride, ``0 <= M <=`` the largest row block of ``W8_MM_CONFIG["tiles"]``
            (128); the no-grad Linear takes it up to ``W8_MM_CONFIG["max_m"]`` rows, and with an fp8 ``x`` up to
            ``max_m_fp8x`` (check :func:`w8_mm_available`).
            A contiguous ``(..., K)`` is taken as its ``M`` rows and gives ``(..., N)``.
            Or fp8 of ``w8``'s dtype with ``x_scale``: see below.
        w8: ``(N, K)`` fp8 (e4m3 / e5m2), unit last stride, on ``x``'s device.
        scale: ``(N, 1)`` contiguous float32 row scales; bias: ``(N,)`` contiguous or None.
        traced: the body of a ``triton_op`` (``wrap_triton``).
        tiles: one row block's tile dict (the keys of ``W8_MM_CONFIG["tiles"][16]``, and ``gemv``: see the table)
            instead of the table's, for tile sweeps (``benchmarks/serve.py --crossover``).
        x_scale: ``(M, 1)`` contiguous float32 row scales of an fp8 ``x`` (quantized per row): the product
            ``((x * x_scale) @ (w8 * scale).T) (+ bias)`` in ``out_dtype`` (bf16 / fp16), the dot fp8 x fp8 (the
            dual-fp8 GEMM of cuBLAS, with the K split for small M).
        one_launch: whether a K split runs as one launch, each program adding its column block's slices in turn
            (the same bits as the split's two launches, with less parallelism: one launch less of host time where
            the host, not the GPU, bounds the step). None (default): eagerly outside CUDA graph capture (an eager
            step is bound by its launches' host time); traced or captured, the split and its reduce launch.

    Float32 accumulation; scale and bias applied in float32 before the one rounding. Split over K in fixed order
    (deterministic) so small N still uses every SM; the float32 partial sums of a split are added by a second launch
    (:func:`launch_w8_mm_partials`: the partial sums alone) or, with ``one_launch``, in the same launch.

    Raises:
        ValueError: ``M`` exceeds the largest row block, or one row with a ``gemv`` tile; ``x`` not 2-D and not
            contiguous; an fp8 ``x`` without
            ``x_scale`` as above, of another fp8 dtype than ``w8``, or a ``out_dtype`` other than bf16 / fp16;
            ``x_scale`` with a high-precision ``x``.
    """
    if one_launch is None:
        one_launch = not traced and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
    if not traced and tiles is None:  # eager: the plan of this x shape, if one was made
        plan = _W8_EAGER.get((x.shape, w8.shape[0], x.dtype, x.device, bias is not None, one_launch,
                              None if x_scale is None else out_dtype))
        if plan is not None and (plan[1] or x.is_contiguous()) and (x_scale is None or (
                x.dtype == w8.dtype and x_scale.dtype == torch.float32 and x_scale.shape == (plan[2], 1)
                and x_scale.is_contiguous())):  # (what the key does not fix; a high-precision x has no scales)
            return _w8_mm_run(x, w8, scale, bias, x_scale, out_dtype if x_scale is not None else x.dtype, *plan)
    K, N = int(x.shape[-1]), int(w8.shape[0])  # (specialized under torch.compile)
    if x.dim() == 2:
        M = int(x.shape[0])
        shape, stride_xm = (M, N), x.stride(0)
    else:  # (..., K) contiguous: rows at stride K, no reshape (a view costs µs of host time per eager call)
        if x.dim() < 2 or not x.is_contiguous():
            raise ValueError(f"fp8tensor launch_w8_mm: x must be (M, K) or a contiguous (..., K); got shape "
                             f"{tuple(x.shape)}, strides {x.stride()}")
        M = int(math.prod(x.shape[:-1]))
        shape, stride_xm = (*x.shape[:-1], N), K
    if M > _W8_MAX_M:
        raise ValueError(f"fp8tensor launch_w8_mm: {M} rows; the decode GEMM has tiles for at most "
                         f"{max(W8_MM_CONFIG['tiles'])} (W8_MM_CONFIG['tiles'])")
    x_fp8 = x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if x_scale is not None and not x_fp8:
        raise ValueError(f"fp8tensor launch_w8_mm: x_scale is for an fp8 x; x is {x.dtype}")
    if x_fp8 and not (x.dtype == w8.dtype and x_scale is not None and x_scale.dtype == torch.float32
                      and tuple(x_scale.shape) == (M, 1) and x_scale.is_contiguous()
                      and out_dtype in (torch.bfloat16, torch.float16)):
        raise ValueError(f"fp8tensor launch_w8_mm: an fp8 x ({x.dtype}) needs the weight's fp8 dtype ({w8.dtype}), "
                         f"x_scale ({M}, 1) contiguous float32 and out_dtype bf16 / fp16")
    dtype = out_dtype if x_fp8 else x.dtype
    out = torch.empty(shape, dtype=dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    has_bias = bias is not None
    key = (x.device, M, N, K, dtype, has_bias, x_fp8, one_launch)
    launch = _W8_LAUNCHES.get(key) if tiles is None else None
    if launch is None:
        launch = _w8_mm_launch(M, N, K, x.device, dtype, has_bias, x_fp8, tiles, one_launch)
        if one_launch and not traced and launch[3] != _w8_mm_plan(M, N, K, x.device, tiles)[3]:
            # The split's launches once as well (the result dropped): a CUDA graph captured after an eager warm-up
            # launches them, and loading a kernel's module while a stream captures is not permitted.
            launch_w8_mm(x, w8, scale, bias, tiles=tiles, x_scale=x_scale, out_dtype=out_dtype, one_launch=False)
        if tiles is None:
            if len(_W8_LAUNCHES) >= 4096:
                _W8_LAUNCHES.clear()
            _W8_LAUNCHES[key] = launch
    if not (traced or tiles is not None):
        if len(_W8_EAGER) >= 4096:
            _W8_EAGER.clear()
        _W8_EAGER[(x.shape, N, x.dtype, x.device, has_bias, one_launch, dtype if x_fp8 else None)] = (
            shape, x.dim() == 2, M, N, K, launch)
    grid, split, k_per, consts, warps, stages, rgrid, rconsts = launch
    b = bias if has_bias else scale  # (scale (N, 1) and x_scale (M, 1) contiguous: the kernels read them flat)
    xs = x_scale if x_fp8 else scale  # (unread without an fp8 x)
    ws = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    args = (x, w8, scale, b, ws, M, N, K, k_per, stride_xm, w8.stride(0), N, M * N, xs)
    _launch(_w8_mm_kernel, grid, args, consts, warps, x.device, stages, traced=traced)
    if split > 1:
        _launch(_w8_mm_reduce_kernel, rgrid, (ws, scale, b, out, M * N, N, xs), rconsts, 4, x.device, traced=traced)
    return out
