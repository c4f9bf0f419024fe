//! Sizes for the host-buffer pool tests (store.rs on the CPU, cuda_model.rs on the GPU).

use flashrt_runtime::ir::Layout;

/// A position whose largest KV regions pass the pool's 1 MiB minimum, with the capsule's bytes
/// there (`one`) and what the pool keeps of it (`big`: its regions of 1 MiB or more), checked
/// to fit the pool of a host tier of one capsule but not two (`2 * one - 1`, the pool half of
/// it). Returns `(pos, one, big, host)`.
pub fn pool_sized(layout: &Layout) -> (usize, u64, u64, u64) {
    let per = layout
        .state_buffers()
        .map(|b| b.bytes_per_token())
        .max()
        .unwrap();
    let pos = (3 << 19) / per + 1;
    let one = layout.capsule_bytes(pos) as u64;
    let big: u64 = layout
        .state_buffers()
        .map(|b| b.used_bytes(pos) as u64)
        .filter(|&n| n >= flashrt_runtime::host_pool::MIN_POOLED as u64)
        .sum();
    let host = 2 * one - 1;
    assert!(big > 0 && big <= host / 2, "{big} of {one}");
    (pos, one, big, host)
}
