#!/usr/bin/env python3
# kernels/gemv.cu `gemvs_tile` (gemv16s_*): its fragment plumbing checked without a GPU.
# Usage: python3 benches/kernels/gemv16s_fragments.py   (needs numpy)
# Emulates gemvs_tile's data movement for one warp and one window with the PTX fragment layouts
# (ldmatrix m8n8 b16; mma.m16n8k16 row.col) and checks that every MMA multiplies
# x[:, k] by W[:, k]^T over exactly the window's columns, each once.
import numpy as np
rng = np.random.default_rng(0)
F, R = 8, 8
K = 32 * 8  # one window: 32 chunks of 8 columns
W = rng.integers(-9, 9, size=(F, K)).astype(np.int64)
X = rng.integers(-9, 9, size=(R, K)).astype(np.int64)

def off(r, c):  # 16-byte slots
    return r * 32 + (c ^ r)

# Lane L stores chunk L of every row (weights) and of every x row (XS path).
smw = {}; smx = {}
for L in range(32):
    for i in range(F):
        smw[off(i, L)] = W[i, 8 * L:8 * L + 8]
    for r in range(R):
        smx[off(r, L)] = X[r, 8 * L:8 * L + 8]
# bank-conflict checks: a store instruction (fixed row) hits 32 distinct slots; an ldmatrix
# phase (fixed matrix) hits 8 rows at distinct 16-byte bank groups.
for r in range(8):
    assert len({off(r, L) for L in range(32)}) == 32
for q in range(8):
    for m in range(4):
        assert len({off(lr, 4 * q + m) % 8 for lr in range(8)}) == 8

def ldsm_x4(sm, q):
    # lane l addresses row l & 7 of matrix l >> 3 (chunk 4q + (l >> 3)); register i of lane l
    # gets row l / 4, columns 2 (l % 4), +1 of matrix i.
    addr = {l: off(l & 7, 4 * q + (l >> 3)) for l in range(32)}
    regs = {}
    for l in range(32):
        out = []
        for i in range(4):
            row = sm[addr[8 * i + l // 4]]
            c = 2 * (l % 4)
            out.append((row[c], row[c + 1]))
        regs[l] = out
    return regs

C = np.zeros((16, 8), dtype=np.int64)
covered = np.zeros(K, dtype=int)
for q in range(8):
    bw = ldsm_x4(smw, q)
    ax = ldsm_x4(smx, q)
    # LDG path: ax[e] = x[g][chunk 4q + e][2 t4 .. +1]
    for l in range(32):
        g, t4 = l // 4, l % 4
        for e in range(4):
            ch = 4 * q + e
            assert tuple(ax[l][e]) == tuple(X[g, ch * 8 + 2 * t4: ch * 8 + 2 * t4 + 2]), "LDG and ldmatrix A differ"
    for h in range(2):
        A = np.zeros((16, 16), dtype=np.int64); B = np.zeros((16, 8), dtype=np.int64)
        for l in range(32):
            g, t4 = l // 4, l % 4
            a0, a2 = ax[l][2 * h], ax[l][2 * h + 1]
            b0, b1 = bw[l][2 * h], bw[l][2 * h + 1]
            A[g, 2 * t4:2 * t4 + 2] = a0; A[g, 2 * t4 + 8:2 * t4 + 10] = a2  # a1 = a3 = 0
            B[2 * t4:2 * t4 + 2, g] = b0; B[2 * t4 + 8:2 * t4 + 10, g] = b1
        # Which columns of W this step multiplied: chunk 4q + 2h (k 0..7), 4q + 2h + 1 (k 8..15).
        ks = list(range((4 * q + 2 * h) * 8, (4 * q + 2 * h) * 8 + 16))
        assert (B == W[:, ks].T).all(), (q, h)
        assert (A[:8] == X[:, ks]).all(), (q, h)
        covered[ks] += 1
        C += A @ B
assert (covered == 1).all()
assert (C[:8] == X @ W.T).all()
# C fragment: lane (g, t4) holds C[g][2 t4], C[g][2 t4 + 1] -> red[warp][g][2 t4 + {0,1}].
print("gemvs fragments: every step multiplies x[:, k] by W[:, k]^T, each column once; C = X W^T")
