//! The sampler on the device (kernels/sample.cu): the algorithm of [`crate::sampling`] over a
//! logits row already on the GPU, so a sampled token costs one small launch and a 4-byte read
//! instead of a host pass over the row. The draw itself (the RNG) stays on the host, in the
//! session's [`SamplerState`](crate::SamplerState); [`SamplerState::draw_spec`] gives the
//! kernel its inputs, computed exactly as the host sampler computes them.
//!
//! [`SamplerState::draw_spec`]: crate::SamplerState::draw_spec

use super::kernels::Kernels;
use super::{CudaBackend, alloc_zeroed, dptr, drv};
use crate::error::{Error, Result};
use crate::sampling::{DrawSpec, PenaltyList};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// `sample_row`'s parameters (kernels/sample.cu `SampleParams`).
#[repr(C)]
#[derive(Clone, Copy)]
struct SampleParams {
    logits: u64,
    out: u64,
    inv_t: f64,
    floor_w: u64,
    top_p: u64,
    draw: u64,
    ws: u64,
    weights: u64,
    list: u64,
    n: u32,
    top_k: u32,
    use_top_p: u32,
    pad: u32,
}

/// Bytes of the header and first-digit histogram at the start of a sampler workspace.
const WS_HEAD: usize = 8 * (2 + 4096);

/// `sample_penalize`'s parameters (kernels/sample.cu `PenalizeParams`).
#[repr(C)]
#[derive(Clone, Copy)]
struct PenalizeParams {
    row: u64,
    entries: u64,
    count: u32,
    n: u32,
    repetition: f32,
    presence: f32,
    frequency: f32,
    use_repetition: u32,
    counted: u32,
    pad: u32,
}

/// Device bytes of a sampler workspace for rows of `n` logits (kernels/sample.cu
/// `SampleParams::ws`): header and histogram, a weight per logit, a list of `n` pairs, 4
/// bytes for the result (padded to 256), then the penalized copy of a row (`n` f32) and its
/// penalty list (at most `n` entries: the ids are distinct and below `n`).
pub(super) fn workspace_bytes(n: usize) -> usize {
    penalty_offset(n) + 4 * n + 8 * n
}

/// Where a workspace's penalized row copy starts (its list follows the `n` f32).
fn penalty_offset(n: usize) -> usize {
    WS_HEAD + 8 * n + 16 * n + 256
}

/// Step 0 on the device: copy the `n` f32 logits at `row` into the workspace at `ws` and
/// apply `list` to the copy (kernels/sample.cu `sample_penalize`); returns the copy's address,
/// the row to sample.
///
/// # Safety
/// As [`sample_on`]: `row` holds `n` f32, `ws` a workspace of [`workspace_bytes`]`(n)`, both
/// live device memory of the stream's context, untouched by other work until the sample that
/// follows has returned.
pub(super) unsafe fn penalize_on(
    kernels: &Kernels,
    stream: &CudaStream,
    row: u64,
    n: usize,
    ws: u64,
    list: &PenaltyList,
) -> Result<u64> {
    if list.entries.len() > n || list.entries.iter().any(|e| e[0] as usize >= n) {
        return Err(Error::Input(format!(
            "sample: a penalty list of {} entries for a row of {n}",
            list.entries.len()
        )));
    }
    let copy = ws + penalty_offset(n) as u64;
    let entries = copy + 4 * n as u64;
    // SAFETY: `copy` and `entries` lie inside the workspace (this function's contract and
    // `workspace_bytes`); the list's host memory is pageable, so the upload has left it when
    // the call returns; the kernel below reads both in stream order.
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(copy, row, 4 * n, stream.cu_stream())
            .map_err(drv("sample: copy the row"))?;
        if !list.entries.is_empty() {
            cudarc::driver::result::memcpy_htod_async(
                entries,
                list.entries.as_flattened(),
                stream.cu_stream(),
            )
            .map_err(drv("sample: upload the penalty list"))?;
        }
    }
    if list.entries.is_empty() {
        return Ok(copy);
    }
    let p = PenalizeParams {
        row: copy,
        entries,
        count: list.entries.len() as u32,
        n: n as u32,
        repetition: list.repetition.unwrap_or(1.0),
        presence: list.presence,
        frequency: list.frequency,
        use_repetition: list.repetition.is_some() as u32,
        counted: list.counted() as u32,
        pad: 0,
    };
    let blocks = list.entries.len().div_ceil(256).min(1024) as u32;
    // SAFETY: `PenalizeParams` is the kernel's parameter struct; the addresses are the
    // workspace's, valid by this function's contract.
    unsafe { launch(kernels, "sample_penalize", blocks, 256, stream, &p)? };
    Ok(copy)
}

/// Launch kernel `name` of the sampler with one by-value parameter struct `p`.
///
/// # Safety
/// `P` must be the kernel's parameter struct (the same `repr(C)` layout) and every address in
/// `p` valid for what the kernel reads and writes, until the stream has run it.
unsafe fn launch<P>(
    kernels: &Kernels,
    name: &str,
    grid: u32,
    block: u32,
    stream: &CudaStream,
    p: &P,
) -> Result<()> {
    let func = kernels.get(name)?;
    let mut args = [p as *const P as *mut std::ffi::c_void];
    // SAFETY: one by-value parameter of the kernel's layout (this function's contract); `p`
    // outlives the launch call, which copies it.
    unsafe {
        cudarc::driver::result::launch_kernel(
            func.cu_function(),
            (grid, 1, 1),
            (block, 1, 1),
            0,
            stream.cu_stream(),
            &mut args,
        )
    }
    .map_err(drv(name))
}

/// Sample from the `n` f32 logits at device address `row` on `stream`, with a workspace of
/// [`workspace_bytes`]`(n)` at `ws`. Blocks until the index is on the host. `None` when no
/// logit is finite (the caller then keeps its RNG state, as the host sampler does).
///
/// # Safety
/// `row` must hold `n` f32 values and `ws` the workspace, both live device memory of the
/// stream's context, not touched by other work until this returns.
pub(super) unsafe fn sample_on(
    kernels: &Kernels,
    stream: &CudaStream,
    row: u64,
    n: usize,
    ws: u64,
    sms: usize,
    spec: &DrawSpec,
) -> Result<Option<u32>> {
    if n == 0 || n > u32::MAX as usize - 1 {
        return Err(Error::Input(format!("sample: a row of {n} logits")));
    }
    let out = ws + (WS_HEAD + 24 * n) as u64;
    let p = SampleParams {
        logits: row,
        out,
        inv_t: spec.inv_t,
        floor_w: spec.floor_w,
        top_p: spec.top_p.unwrap_or(0),
        draw: spec.draw,
        ws,
        weights: ws + WS_HEAD as u64,
        list: ws + (WS_HEAD + 8 * n) as u64,
        n: n as u32,
        top_k: spec.top_k,
        use_top_p: spec.top_p.is_some() as u32,
        pad: 0,
    };
    // SAFETY: the header and histogram lie at the start of the workspace (this function's
    // contract); ordered on the stream before the kernels that accumulate into them.
    unsafe { cudarc::driver::result::memset_d8_async(ws, 0, WS_HEAD, stream.cu_stream()) }
        .map_err(drv("sample: clear the workspace"))?;
    let grid = n.div_ceil(256).min(2 * sms.max(1)) as u32;
    for (name, grid, block) in [
        ("sample_best", grid, 256),
        ("sample_weigh", grid, 256),
        ("sample_pick", 1, 1024),
    ] {
        // SAFETY: each kernel takes one by-value `SampleParams`; the addresses are valid by
        // this function's contract.
        unsafe { launch(kernels, name, grid, block, stream, &p)? };
    }
    let mut id = [0u32; 1];
    // SAFETY: `out` holds 4 bytes written by the kernel above, in stream order; `id` is 4
    // bytes of host memory, and a copy into pageable memory completes before this returns.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut id, out, stream.cu_stream()) }
        .map_err(drv("sample: read the index"))?;
    stream.synchronize().map_err(drv("sample"))?;
    Ok((id[0] != u32::MAX).then_some(id[0]))
}

/// Greedy: [`crate::argmax`] of the `n` f32 logits at device address `row` on `stream`
/// (kernels/sample.cu `sample_argmax`: one launch), with the workspace at `ws`. Blocks until
/// the index is on the host. `None` when every value is NaN.
///
/// # Safety
/// As [`sample_on`].
pub(super) unsafe fn argmax_on(
    kernels: &Kernels,
    stream: &CudaStream,
    row: u64,
    n: usize,
    ws: u64,
    sms: usize,
) -> Result<Option<u32>> {
    if n == 0 || n > u32::MAX as usize - 1 {
        return Err(Error::Input(format!("argmax: a row of {n} logits")));
    }
    let p = SampleParams {
        logits: row,
        out: 0,
        inv_t: 1.0,
        floor_w: 0,
        top_p: 0,
        draw: 0,
        ws,
        weights: 0,
        list: 0,
        n: n as u32,
        top_k: 1,
        use_top_p: 0,
        pad: 0,
    };
    // SAFETY: the key slot is the workspace's first 8 bytes (this function's contract),
    // cleared in stream order before the kernel's atomics.
    unsafe { cudarc::driver::result::memset_d8_async(ws, 0, 8, stream.cu_stream()) }
        .map_err(drv("argmax: clear the key"))?;
    let grid = n.div_ceil(256).min(2 * sms.max(1)) as u32;
    // SAFETY: the kernel takes one by-value `SampleParams` and reads `logits`, `n` and `ws[0]`,
    // valid by this function's contract.
    unsafe { launch(kernels, "sample_argmax", grid, 256, stream, &p)? };
    let mut key = [0u64; 1];
    // SAFETY: the slot's 8 bytes were written by the kernel above, in stream order; a copy into
    // pageable memory completes before this returns.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut key, ws, stream.cu_stream()) }
        .map_err(drv("argmax: read the key"))?;
    stream.synchronize().map_err(drv("argmax"))?;
    Ok((key[0] != 0).then(|| u32::MAX - key[0] as u32))
}

/// The device sampler on rows that come from the host: what the tests check against the host
/// sampler bit for bit, and what a benchmark times. (Sessions sample the row their step left
/// in the I/O arena instead: [`crate::backend::DeviceSession::sample_row`].)
pub struct CudaSampler {
    kernels: Kernels,
    stream: Arc<CudaStream>,
    row: CudaSlice<u8>,
    ws: CudaSlice<u8>,
    cap: usize,
    sms: usize,
}

impl CudaSampler {
    /// A sampler for rows of up to `max_n` logits.
    pub fn new(backend: &CudaBackend, max_n: usize) -> Result<CudaSampler> {
        let ctx = backend.context();
        ctx.bind_to_thread().map_err(drv("bind context"))?;
        let kernels = Kernels::load(ctx)?;
        let stream = ctx.new_stream().map_err(drv("create stream"))?;
        let row = alloc_zeroed(&stream, 4 * max_n.max(1), "sampler row")?;
        let ws = alloc_zeroed(&stream, workspace_bytes(max_n), "sampler workspace")?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(drv("device attributes"))?
            .max(1) as usize;
        Ok(CudaSampler {
            kernels,
            stream,
            row,
            ws,
            cap: max_n,
            sms,
        })
    }

    /// Copy `row` to the device and sample it with `spec`.
    pub fn sample(&mut self, row: &[f32], spec: &DrawSpec) -> Result<Option<u32>> {
        self.sample_penalized(row, spec, None)
    }

    /// Copy `row` to the device and take its greedy choice there ([`argmax_on`]).
    pub fn argmax(&mut self, row: &[f32]) -> Result<Option<u32>> {
        let dst = self.upload(row)?;
        // SAFETY: the row and workspace are this sampler's, used only on its stream.
        unsafe {
            argmax_on(
                &self.kernels,
                &self.stream,
                dst,
                row.len(),
                dptr(&self.ws),
                self.sms,
            )
        }
    }

    /// Copy `row` into the sampler's device row (its address).
    fn upload(&mut self, row: &[f32]) -> Result<u64> {
        if row.len() > self.cap {
            return Err(Error::Input(format!(
                "a row of {} logits, the sampler holds {}",
                row.len(),
                self.cap
            )));
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(drv("bind context"))?;
        let dst = dptr(&self.row);
        // SAFETY: `dst` holds `cap >= row.len()` f32; the copy from pageable memory completes
        // before a launch on the same stream reads it, and `row` outlives it (the sampler
        // synchronises before returning).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, row, self.stream.cu_stream()) }
            .map_err(drv("sampler: copy the row"))?;
        Ok(dst)
    }

    /// Copy `row` to the device, apply `penalties` to a copy of it there (step 0) and sample
    /// that with `spec`.
    pub fn sample_penalized(
        &mut self,
        row: &[f32],
        spec: &DrawSpec,
        penalties: Option<&PenaltyList>,
    ) -> Result<Option<u32>> {
        let dst = self.upload(row)?;
        // SAFETY: the row, workspace and result buffers are this sampler's, used only on its
        // stream.
        unsafe {
            let src = match penalties {
                Some(list) => penalize_on(
                    &self.kernels,
                    &self.stream,
                    dst,
                    row.len(),
                    dptr(&self.ws),
                    list,
                )?,
                None => dst,
            };
            sample_on(
                &self.kernels,
                &self.stream,
                src,
                row.len(),
                dptr(&self.ws),
                self.sms,
                spec,
            )
        }
    }
}
