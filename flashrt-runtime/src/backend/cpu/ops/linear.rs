//! `Op::Linear`: `out = x Wᵀ (+ bias)` over row blocks and threads, with an AVX2 inner loop
//! where the CPU has it (same f32 operations in the same order either way).

use super::*;

/// Raw output pointer shared by the threads of one `linear` call.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: threads write disjoint column ranges of the output (see `linear`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Output columns per cache block (the block's weight rows stay in L2 across row blocks).
fn col_block(k: usize) -> usize {
    ((256 * 1024) / (4 * k.max(1))).clamp(8, 1024)
}

/// `Op::Linear`: `out[r][j] (+)= dot(x[r], w[j]) (+ bias[j])`. `x`: `[len, k]`, `w`: `[n, k]`.
/// Work is split over output columns between `threads` threads; every element is computed by
/// the same code whatever the split, so results do not depend on the thread count.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    x: &[f32],
    len: usize,
    k: usize,
    w: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut OutRows,
    accumulate: bool,
    threads: usize,
) {
    assert!(out.width == n && x.len() >= len * k && w.len() >= n * k);
    assert!(len == 0 || out.base + (len - 1) * out.stride + n <= out.data.len());
    if let Some(b) = bias {
        assert!(b.len() >= n);
    }
    let work = len * k * n;
    let threads = if work < (1 << 22) {
        1
    } else {
        threads.clamp(1, n.div_ceil(64))
    };
    let ptr = OutPtr(out.data.as_mut_ptr());
    let (base, stride) = (out.base, out.stride);
    let run = move |j0: usize, j1: usize| {
        // SAFETY: the asserts above keep every index `base + r * stride + j` (r < len,
        // j < n) inside `out.data`, which outlives this call; callers of `run` use disjoint
        // column ranges `[j0, j1)`, so no element is written by two threads and none is read
        // by another thread.
        unsafe { linear_cols(x, len, k, w, bias, ptr, base, stride, j0, j1, accumulate) }
    };
    if threads <= 1 {
        run(0, n);
        return;
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        for t in 1..threads {
            let (j0, j1) = ((t * per).min(n), ((t + 1) * per).min(n));
            if j0 < j1 {
                s.spawn(move || run(j0, j1));
            }
        }
        run(0, per.min(n));
    });
}

/// Columns `[j0, j1)` of a linear layer, compiled for AVX2 when the CPU has it. The AVX2
/// copy runs exactly the same lane-wise f32 operations (no FMA: Rust never contracts), so
/// both copies give identical bits.
///
/// # Safety
/// `out.0 + base + r * stride + j` must be valid for writes for every `r < len`,
/// `j0 <= j < j1`, and no other thread may access those elements during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn linear_cols(
    x: &[f32],
    len: usize,
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    out: OutPtr,
    base: usize,
    stride: usize,
    j0: usize,
    j1: usize,
    accumulate: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is available (checked above); the output contract is the caller's.
        unsafe { linear_cols_avx2(x, len, k, w, bias, out, base, stride, j0, j1, accumulate) };
        return;
    }
    // SAFETY: the caller's contract is passed on unchanged.
    unsafe { linear_cols_impl(x, len, k, w, bias, out, base, stride, j0, j1, accumulate) }
}

/// # Safety
/// As [`linear_cols`], and the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn linear_cols_avx2(
    x: &[f32],
    len: usize,
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    out: OutPtr,
    base: usize,
    stride: usize,
    j0: usize,
    j1: usize,
    accumulate: bool,
) {
    // SAFETY: the caller's contract is passed on unchanged.
    unsafe { linear_cols_impl(x, len, k, w, bias, out, base, stride, j0, j1, accumulate) }
}

/// # Safety
/// As [`linear_cols`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn linear_cols_impl(
    x: &[f32],
    len: usize,
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    out: OutPtr,
    base: usize,
    stride: usize,
    j0: usize,
    j1: usize,
    accumulate: bool,
) {
    let store = |r: usize, j: usize, v: f32| {
        let v = match bias {
            Some(b) => v + b[j],
            None => v,
        };
        // SAFETY: guaranteed by the caller (see the function's contract).
        unsafe {
            let p = out.0.add(base + r * stride + j);
            *p = if accumulate { *p + v } else { v };
        }
    };
    let xr = |r: usize| &x[r * k..(r + 1) * k];
    let wr = |j: usize| &w[j * k..(j + 1) * k];
    // One micro-kernel call: rows r0.., columns j.. (R x C outputs).
    macro_rules! block {
        ($r:literal, $c:literal, $r0:expr, $j:expr) => {{
            let v = dot_block::<$r, $c>(
                std::array::from_fn(|i| xr($r0 + i)),
                std::array::from_fn(|c| wr($j + c)),
            );
            for (i, row) in v.into_iter().enumerate() {
                for (c, val) in row.into_iter().enumerate() {
                    store($r0 + i, $j + c, val);
                }
            }
        }};
    }
    let jb = col_block(k);
    let mut c0 = j0;
    while c0 < j1 {
        let c1 = (c0 + jb).min(j1);
        let mut r0 = 0;
        while r0 < len {
            let rows = (len - r0).min(4);
            let mut j = c0;
            while j < c1 {
                let cols = if rows == 1 { 1 } else { (c1 - j).min(2) };
                match (rows, cols) {
                    (4, 2) => block!(4, 2, r0, j),
                    (4, _) => block!(4, 1, r0, j),
                    (3, 2) => block!(3, 2, r0, j),
                    (3, _) => block!(3, 1, r0, j),
                    (2, 2) => block!(2, 2, r0, j),
                    (2, _) => block!(2, 1, r0, j),
                    (_, 2) => block!(1, 2, r0, j),
                    _ => block!(1, 1, r0, j),
                }
                j += cols;
            }
            r0 += rows;
        }
        c0 = c1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::ops::lcg;

    #[test]
    fn linear_rows_and_threads_are_bitwise_stable() {
        let (len, k, n) = (7, 83, 50);
        let mut s = 1;
        let x: Vec<f32> = (0..len * k).map(|_| lcg(&mut s)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut s)).collect();
        let bias: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
        let run = |rows: std::ops::Range<usize>, threads: usize| {
            let mut data = vec![0f32; len * n];
            let m = rows.len();
            let mut out = OutRows {
                data: &mut data,
                base: rows.start * n,
                stride: n,
                width: n,
            };
            linear(
                &x[rows.start * k..],
                m,
                k,
                &w,
                n,
                Some(&bias),
                &mut out,
                false,
                threads,
            );
            data
        };
        let all = run(0..len, 1);
        // Row i is the same whichever block of rows it is computed in.
        for start in 0..len {
            let part = run(start..len, 1);
            assert_eq!(&part[start * n..], &all[start * n..]);
            let one = run(start..start + 1, 1);
            assert_eq!(
                &one[start * n..(start + 1) * n],
                &all[start * n..(start + 1) * n]
            );
        }
        // Reference: naive per-element dot.
        for r in 0..len {
            for j in 0..n {
                let want = dot(&x[r * k..(r + 1) * k], &w[j * k..(j + 1) * k]) + bias[j];
                assert_eq!(all[r * n + j], want);
            }
        }
    }

    #[test]
    fn linear_threads_do_not_change_results() {
        let (len, k, n) = (5, 1024, 1000);
        let mut s = 7;
        let x: Vec<f32> = (0..len * k).map(|_| lcg(&mut s)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut s)).collect();
        let mut a = vec![0f32; len * n];
        let mut b = vec![0f32; len * n];
        linear(
            &x,
            len,
            k,
            &w,
            n,
            None,
            &mut OutRows {
                data: &mut a,
                base: 0,
                stride: n,
                width: n,
            },
            false,
            1,
        );
        linear(
            &x,
            len,
            k,
            &w,
            n,
            None,
            &mut OutRows {
                data: &mut b,
                base: 0,
                stride: n,
                width: n,
            },
            false,
            3,
        );
        assert_eq!(a, b);
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// `cargo test --release -p flashrt-runtime --lib -- --ignored linear_gflops --nocapture`
    #[test]
    #[ignore]
    fn linear_gflops() {
        for (len, k, n, threads) in [(1, 2048, 8192, 1), (64, 2048, 2048, 1), (64, 2048, 2048, 2)] {
            let x = vec![0.5f32; len * k];
            let w = vec![0.25f32; n * k];
            let mut out = vec![0f32; len * n];
            let t = std::time::Instant::now();
            let reps = 5;
            for _ in 0..reps {
                let mut o = OutRows {
                    data: &mut out,
                    base: 0,
                    stride: n,
                    width: n,
                };
                linear(&x, len, k, &w, n, None, &mut o, false, threads);
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "len {len} k {k} n {n} threads {threads}: {:.2} ms, {:.1} GFLOP/s",
                s * 1e3,
                2.0 * (len * k * n) as f64 / s / 1e9
            );
        }
    }
}
