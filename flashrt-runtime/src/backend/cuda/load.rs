//! Weights to the device: the weight arena and the [`CudaSink`] that fills it from a loader
//! through a ring of pinned staging buffers (converting on the device where the stored dtype is
//! not the arena's), or generates random weights in place.

use super::*;

/// `convert`'s parameters (kernels/init.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct ConvertParams {
    out: u64,
    input: u64,
    n: u64,
    src_kind: u32,
    pad: u32,
}

/// Bytes of each pinned staging slot of a [`CudaSink`] (the loader's pieces fit one).
const STAGING_BYTES: usize = 32 << 20;
/// Staging slots: one being filled from the page cache while the others' copies run.
const STAGING_SLOTS: usize = 4;

/// One pinned staging buffer, the device buffer a conversion reads (allocated on first
/// need), and the event after the last copy that read it.
struct Slot {
    host: PinnedHostSlice<u8>,
    dev: Option<CudaSlice<u8>>,
    done: CudaEvent,
}

/// The CUDA backend's weight sink: the weight arena, allocated once, filled through a ring of
/// pinned staging buffers. A piece is copied from the loader's bytes (the page cache) into the
/// next free slot, then moved to the device asynchronously on the sink's stream — straight into
/// the arena when the stored dtype is the buffer's, else into the slot's device buffer and
/// converted by `convert_<dtype>` into the arena. While a slot's copy runs, the next slot is
/// being filled, so host reads and host-to-device copies overlap; host memory in use is the
/// ring, whatever the checkpoint's size.
pub struct CudaSink {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    options: CudaOptions,
    kernels: Kernels,
    blas: Blas,
    stream: Arc<CudaStream>,
    arena: CudaSlice<u8>,
    base: u64,
    fill: WeightFill,
    slots: Vec<Slot>,
    next: usize,
    /// FP8 weights arriving as floats: a bf16 copy each until every piece is in and the
    /// copy is quantized into the arena (`fp8_quantize`).
    temps: std::collections::HashMap<BufferId, CudaSlice<u8>>,
    /// Quantized weights already quantized that way.
    quantized: std::collections::HashSet<BufferId>,
}

impl CudaSink {
    pub(super) fn new(backend: &CudaBackend, compiled: &Compiled) -> Result<CudaSink> {
        backend.ctx.bind_to_thread().map_err(drv("bind context"))?;
        let layout = &compiled.layout;
        let want = backend.target(&compiled.ir);
        if layout.target != want {
            return Err(Error::Config(format!(
                "model `{}` was compiled for {} but the CUDA backend computes it in {}",
                layout.model,
                layout.target.dtype.name(),
                want.dtype.name()
            )));
        }
        let kernels = Kernels::load(&backend.ctx)?;
        let blas = Blas::new()?;
        let stream = backend.ctx.new_stream().map_err(drv("create stream"))?;
        let arena = alloc_zeroed(&stream, layout.arena_bytes(Role::Weight), "weight arena")?;
        stream.synchronize().map_err(drv("allocate weight arena"))?;
        let base = dptr(&arena);
        Ok(CudaSink {
            ctx: backend.ctx.clone(),
            ordinal: backend.ordinal,
            name: backend.name.clone(),
            options: backend.options,
            kernels,
            blas,
            stream,
            arena,
            base,
            fill: WeightFill::new(compiled),
            slots: Vec::new(),
            next: 0,
            temps: Default::default(),
            quantized: Default::default(),
        })
    }

    /// Launch `<kernel>_<dtype>` with one by-value parameter struct on the sink's stream.
    fn launch<P: Copy>(
        &self,
        kernel: &str,
        dtype: DType,
        grid: (u32, u32, u32),
        p: &P,
        what: &str,
    ) -> Result<()> {
        let func = self.kernels.typed(kernel, dtype)?;
        let mut args = [p as *const P as *mut std::ffi::c_void];
        // SAFETY: every kernel launched here takes exactly one by-value parameter struct of
        // type P (repr(C), mirrored in kernels/*.cu); the addresses inside point into the live
        // weight arena or this sink's staging and temporary buffers, used only by this stream;
        // `p` outlives the call, which copies the parameters.
        unsafe {
            cudarc::driver::result::launch_kernel(
                func.cu_function(),
                grid,
                (256, 1, 1),
                0,
                self.stream.cu_stream(),
                &mut args,
            )
        }
        .map_err(drv(what))
    }

    /// Quantize weight `id` by the reference rule (kernels/fp8.cu `fp8_quantize`): from its
    /// bf16 copy `src` into the arena's codes when the buffer is FP8, else in place (its
    /// values become the dequantized ones). Computes and marks its scales.
    fn quantize(&mut self, id: BufferId, src: Option<u64>) -> Result<()> {
        let q = self.fill.quant(id).ok_or_else(|| {
            Error::Config(format!(
                "`{}` is not a quantized weight",
                self.fill.name(id)
            ))
        })?;
        let (off, numel, dtype) = self.fill.place(id);
        let (soff, ..) = self.fill.place(q.scale);
        let at = self.base + off as u64;
        let (kernel_dtype, p) = match src {
            Some(src) => (
                DType::Bf16,
                ops::Fp8QuantizeParams {
                    src,
                    codes: at,
                    values: 0,
                    scales: self.base + soff as u64,
                    g: ops::Fp8GridParams::of(&q, numel)?,
                },
            ),
            None => (
                dtype,
                ops::Fp8QuantizeParams {
                    src: at,
                    codes: 0,
                    values: at,
                    scales: self.base + soff as u64,
                    g: ops::Fp8GridParams::of(&q, numel)?,
                },
            ),
        };
        let blocks = (numel / q.cols / q.segment * q.block_rows()) as u32;
        let name = self.fill.name(id).to_string();
        self.launch(
            "fp8_quantize",
            kernel_dtype,
            (blocks, q.block_cols() as u32, 1),
            &p,
            &format!("quantize weight `{name}`"),
        )?;
        self.fill.mark_full(q.scale);
        self.quantized.insert(id);
        Ok(())
    }

    /// Generate [`crate::init::random_weights`] in place (no host staging).
    pub(super) fn fill_random(&mut self, compiled: &Compiled, seed: u64) -> Result<()> {
        let inits = crate::init::weight_inits(compiled);
        for b in compiled
            .layout
            .buffers
            .iter()
            .filter(|b| b.role == Role::Weight)
        {
            let Some(init) = inits[b.id.index()] else {
                continue;
            };
            let (kind, a, bb) = init.params();
            // An FP8 weight's values are generated in bf16 and quantized from there (the
            // values every backend quantizes: `quant::quantize` rounds to bf16 first).
            let temp = if b.dtype == DType::F8E4m3 {
                Some(alloc_zeroed(
                    &self.stream,
                    2 * b.numel(),
                    "FP8 weight staging",
                )?)
            } else {
                None
            };
            let p = InitParams {
                out: temp.as_ref().map_or(self.base + b.offset as u64, dptr),
                n: b.numel() as u64,
                seed,
                buffer: b.id.0,
                kind,
                a,
                b: bb,
            };
            let gen_dtype = if temp.is_some() { DType::Bf16 } else { b.dtype };
            let func = self.kernels.typed("init_random", gen_dtype)?;
            let grid = (b.numel().div_ceil(256).clamp(1, 8192) as u32, 1, 1);
            let mut args = [&p as *const InitParams as *mut std::ffi::c_void];
            // SAFETY: `init_random_<dtype>` takes one by-value `InitParams` (same repr(C)
            // layout as kernels/init.cu); it writes `n` elements of the buffer's dtype at
            // `out`, a range inside the live weight arena, which only this stream touches; `p`
            // outlives the launch call, which copies the parameters.
            unsafe {
                cudarc::driver::result::launch_kernel(
                    func.cu_function(),
                    grid,
                    (256, 1, 1),
                    0,
                    self.stream.cu_stream(),
                    &mut args,
                )
            }
            .map_err(drv(&format!("init weight `{}`", b.name)))?;
            self.fill.mark_full(b.id);
            if let Some(temp) = temp {
                self.quantize(b.id, Some(dptr(&temp)))?;
            }
        }
        Ok(())
    }

    /// The next staging slot, once its previous copy has finished.
    fn slot(&mut self) -> Result<usize> {
        if self.slots.len() < STAGING_SLOTS {
            // SAFETY: a slot's bytes are only read by copies of the range just written.
            let host = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(STAGING_BYTES, 0) }
                .map_err(drv("allocate pinned staging"))?;
            let done = self.ctx.new_event(None).map_err(drv("create event"))?;
            self.slots.push(Slot {
                host,
                dev: None,
                done,
            });
            return Ok(self.slots.len() - 1);
        }
        let i = self.next;
        self.next = (self.next + 1) % STAGING_SLOTS;
        self.slots[i]
            .done
            .synchronize()
            .map_err(drv("weight upload"))?;
        Ok(i)
    }
}

impl WeightSink for CudaSink {
    fn put(&mut self, id: BufferId, first: usize, dtype: SourceDtype, bytes: &[u8]) -> Result<()> {
        let target = self.fill.put(id, first, dtype, bytes.len())?;
        let name = self.fill.name(id).to_string();
        if target.dtype == DType::I32 {
            return Err(Error::Unsupported(format!("weight `{name}` of dtype i32")));
        }
        // Floats for an FP8 weight go to its bf16 copy, quantized once the last piece is in.
        let staged = target.dtype == DType::F8E4m3 && dtype != SourceDtype::F8E4m3;
        let (to, base) = if staged {
            if !self.temps.contains_key(&id) {
                let (_, numel, _) = self.fill.place(id);
                let t = alloc_zeroed(&self.stream, 2 * numel, "FP8 weight staging")?;
                self.temps.insert(id, t);
            }
            (DType::Bf16, dptr(&self.temps[&id]) + 2 * first as u64)
        } else {
            (target.dtype, self.base + target.offset as u64)
        };
        let same = dtype.layout_dtype() == Some(to);
        let per = STAGING_BYTES / dtype.size();
        for (k, chunk) in bytes.chunks(per * dtype.size()).enumerate() {
            let count = chunk.len() / dtype.size();
            let dst = base + (k * per * to.size()) as u64;
            let i = self.slot()?;
            let stream = self.stream.cu_stream();
            let slot = &mut self.slots[i];
            let host = slot.host.as_mut_slice().map_err(drv("staging"))?;
            host[..chunk.len()].copy_from_slice(chunk);
            if same {
                // SAFETY: the source is the slot's pinned buffer, not written again before
                // `done` (recorded below) completes; the destination range lies inside the
                // weight arena (checked against the buffer's extent above).
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(dst, &host[..chunk.len()], stream)
                }
                .map_err(drv(&format!("upload weight `{name}`")))?;
            } else {
                if slot.dev.is_none() {
                    slot.dev = Some(alloc_zeroed(
                        &self.stream,
                        STAGING_BYTES,
                        "conversion staging",
                    )?);
                }
                let src = dptr(slot.dev.as_ref().expect("allocated above"));
                // SAFETY: as above; the device staging buffer holds STAGING_BYTES and is only
                // used by this stream, in order.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(src, &host[..chunk.len()], stream)
                }
                .map_err(drv(&format!("upload weight `{name}`")))?;
                let p = ConvertParams {
                    out: dst,
                    input: src,
                    n: count as u64,
                    src_kind: match dtype {
                        SourceDtype::F32 => 0,
                        SourceDtype::F16 => 1,
                        SourceDtype::Bf16 => 2,
                        SourceDtype::F64 => 3,
                        SourceDtype::F8E4m3 => 4,
                    },
                    pad: 0,
                };
                let func = self.kernels.typed("convert", to)?;
                let grid = (count.div_ceil(256).clamp(1, 4096) as u32, 1, 1);
                let mut args = [&p as *const ConvertParams as *mut std::ffi::c_void];
                // SAFETY: `convert_<dtype>` takes one by-value `ConvertParams` (same repr(C)
                // layout as kernels/init.cu); it reads `count` source elements from the staging
                // buffer and writes `count` elements of `to` inside the weight arena.
                unsafe {
                    cudarc::driver::result::launch_kernel(
                        func.cu_function(),
                        grid,
                        (256, 1, 1),
                        0,
                        stream,
                        &mut args,
                    )
                }
                .map_err(drv(&format!("convert weight `{name}`")))?;
            }
            slot.done
                .record(&self.stream)
                .map_err(drv("weight upload"))?;
        }
        if staged && self.fill.complete(id) {
            let temp = self.temps.remove(&id).expect("staged above");
            self.quantize(id, Some(dptr(&temp)))?;
            // Freed in stream order, after the quantization that reads it.
            drop(temp);
        }
        Ok(())
    }

    fn finish(self: Box<Self>, compiled: Arc<Compiled>) -> Result<Arc<dyn DeviceModel>> {
        let mut sink = *self;
        sink.ctx.bind_to_thread().map_err(drv("bind context"))?;
        // Quantized weights held as values: scale the codes that arrived, quantize the floats.
        for job in sink.fill.quant_jobs()? {
            match job {
                QuantJob::Dequantize { weight, quant } => {
                    let (off, numel, dtype) = sink.fill.place(weight);
                    let (soff, ..) = sink.fill.place(quant.scale);
                    let p = ops::Fp8DequantParams {
                        codes: 0,
                        values: sink.base + off as u64,
                        scales: sink.base + soff as u64,
                        g: ops::Fp8GridParams::of(&quant, numel)?,
                    };
                    let name = sink.fill.name(weight).to_string();
                    sink.launch(
                        "fp8_dequant",
                        dtype,
                        (numel.div_ceil(256).clamp(1, 8192) as u32, 1, 1),
                        &p,
                        &format!("dequantize weight `{name}`"),
                    )?;
                }
                QuantJob::Quantize { weight, .. } => {
                    if !sink.quantized.contains(&weight) && sink.fill.complete(weight) {
                        sink.quantize(weight, None)?;
                    }
                }
            }
        }
        sink.stream.synchronize().map_err(drv("weight upload"))?;
        sink.temps.clear();
        sink.fill.finish(&compiled)?;
        let sms = sink
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(drv("device attributes"))?
            .max(1) as usize;
        // sm_90a code (wgmma) is in the fatbin for compute capability 9.0 only.
        let cc = sink.ctx.compute_capability().ok();
        let sm90a = cc == Some((9, 0));
        // Thread-block clusters: compute capability 9.0 and later.
        let clusters = cc.is_some_and(|(major, _)| major >= 9);
        // Per-row states need the fused Gated DeltaNet kernel (it writes them).
        let row_layout = (sink.options.row_states && clusters && sink.options.gdn_fused)
            .then(|| ops::RowStateArea::layout(&compiled))
            .filter(|(offsets, _)| !offsets.is_empty());
        Ok(Arc::new(CudaModel {
            inner: Arc::new(ModelInner {
                ctx: sink.ctx,
                ordinal: sink.ordinal,
                name: sink.name,
                compiled,
                kernels: sink.kernels,
                blas: sink.blas,
                weight_base: sink.base,
                _weights: sink.arena,
                options: sink.options,
                sms,
                wgmma: sm90a && sink.options.attn_wgmma,
                moe_wgmma: sm90a && sink.options.moe_wgmma,
                gdn_fused: clusters && sink.options.gdn_fused,
                fp8_gemm: cc.is_some_and(|(major, _)| major == 9) && sink.options.fp8_gemm,
                gemv_mma: cc.is_some_and(|(major, _)| major == 9) && sink.options.gemv_mma,
                gemv16_mma: cc.is_some_and(|(major, _)| major == 9) && sink.options.gemv16_mma,
                gemv16_smem: cc.is_some_and(|(major, _)| major == 9) && sink.options.gemv16_smem,
                row_layout,
                exec: Mutex::new(None),
                sessions: AtomicU64::new(1),
                batch_profile_next: AtomicBool::new(false),
                batch_profile: Mutex::new(None),
            }),
        }))
    }
}
