"""Emulates kernels/gemv_tc.cu's data movement for one 64-wide column block (8 weight rows, R input rows):
the whole-line loads, `gemvm_exchange`'s shuffles (each source lane passing its own selection),
and the operands of the four `mma.sync.m16n8k16` in the PTX ISA's fragment layouts (A: rows
groupID / groupID + 8, columns 2 tig + {0, 1} / + 8; B: rows 2 tig + {0, 1} / + 8, column
groupID; C: row groupID, columns 2 tig + {0, 1}), and checks the products against x @ W.T.
It checks the index plumbing only; gemvm_micro.cu checks the kernel on the GPU.

    python3 benches/kernels/gemv_tc_fragments.py      (numpy)
"""
import numpy as np


def check(R, FEATS, rng):
    W=rng.standard_normal((8,64)); W[FEATS:]=0  # rows past FEATS: no load (zeros)
    X=rng.standard_normal((R,64))
    # loads: instruction rg, lane l -> row 4rg + l//8, piece l%8 (8 elements)
    def load(rg,l): return W[4*rg+l//8, 8*(l%8):8*(l%8)+8]
    in0=[load(0,l) for l in range(32)]; in1=[load(1,l) for l in range(32)]
    s0=[None]*32; s1=[None]*32
    for lane in range(32):
        g,q=lane>>2,lane&3; lo=g<4; base=8*(g&3)+2*q
        src0=base+(0 if lo else 1); src1=base+(1 if lo else 0)
        v0 = in1[src0] if src0&1 else in0[src0]   # source lane's own `odd ? in1 : in0`
        v1 = in0[src1] if src1&1 else in1[src1]   # source lane's `odd ? in0 : in1`
        r0,r1=v0,v1
        s0[lane]=r0 if lo else r1; s1[lane]=r1 if lo else r0
    # check the exchange gives lane (g,q) pieces 2q, 2q+1 of row g
    for lane in range(32):
        g,q=lane>>2,lane&3
        assert np.array_equal(s0[lane],W[g,16*q:16*q+8]) and np.array_equal(s1[lane],W[g,16*q+8:16*q+16]), lane
    C=np.zeros((16,8))
    for t in range(4):
        A=np.zeros((16,16)); B=np.zeros((16,8))
        for lane in range(32):
            g,q=lane>>2,lane&3
            w=np.concatenate([s0[lane],s1[lane]]).reshape(8,2)   # words
            xa=X[g,16*q:16*q+16].reshape(8,2) if g<R else np.zeros((8,2))
            b0,b1=w[2*t],w[2*t+1]; a0,a2=xa[2*t],xa[2*t+1]
            B[2*q:2*q+2,g]=b0; B[2*q+8:2*q+10,g]=b1
            A[g,2*q:2*q+2]=a0; A[g,2*q+8:2*q+10]=a2   # a1, a3 (rows g+8) zero
        C+=A@B
    # lane (g,q) holds c0=C[g][2q], c1=C[g][2q+1]
    ref=X@W.T
    assert np.allclose(C[:R,:FEATS],ref[:, :FEATS]), np.abs(C[:R]-ref).max()
    assert np.allclose(C[8:],0)


rng=np.random.default_rng(0)
for R in (1, 2, 3, 8):
    for FEATS in (4, 8):
        check(R, FEATS, rng)
print("fragment plumbing matches x @ W.T for 1, 2, 3 and 8 rows, 4 and 8 weight rows")
