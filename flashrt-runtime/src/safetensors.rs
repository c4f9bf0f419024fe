//! Safetensors files, read through the format's reference crate (`safetensors`) over a
//! memory map, and written through it.
//!
//! Layout of a file: an 8-byte little-endian header length `n`, `n` bytes of JSON
//! (`{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}`),
//! then the data, with offsets relative to the end of the header. Every file is untrusted: the
//! crate checks the header length, the JSON, that the offsets tile the data section exactly
//! and that every tensor's byte size is its shape times its dtype; any defect becomes an
//! [`Error::Checkpoint`] naming the file (and the tensor, where one is at fault), never a
//! panic.
//!
//! [`SafeTensors::open`] maps the file instead of reading it: parsing touches only the header,
//! and a loader streams tensor data straight from the page cache, dropping pages from the
//! process once they are copied ([`SafeTensors::release`]), so resident memory does not grow
//! with the file.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// Element type of a stored tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dtype {
    F64,
    F32,
    F16,
    Bf16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
    /// OCP FP8 E4M3 (`float8_e4m3fn`): the elements of block-quantized weights.
    F8E4m3,
    /// A dtype this reader does not convert (other fp8 variants, ...); usable only if unused.
    Other(String),
}

impl Dtype {
    pub fn parse(s: &str) -> Dtype {
        match s {
            "F64" => Dtype::F64,
            "F32" => Dtype::F32,
            "F16" => Dtype::F16,
            "BF16" => Dtype::Bf16,
            "I64" => Dtype::I64,
            "I32" => Dtype::I32,
            "I16" => Dtype::I16,
            "I8" => Dtype::I8,
            "U8" => Dtype::U8,
            "BOOL" => Dtype::Bool,
            "F8_E4M3" => Dtype::F8E4m3,
            other => Dtype::Other(other.to_string()),
        }
    }
    pub fn name(&self) -> &str {
        match self {
            Dtype::F64 => "F64",
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
            Dtype::I16 => "I16",
            Dtype::I8 => "I8",
            Dtype::U8 => "U8",
            Dtype::Bool => "BOOL",
            Dtype::F8E4m3 => "F8_E4M3",
            Dtype::Other(s) => s,
        }
    }
    /// Bytes per element; `None` for dtypes whose size this reader does not know.
    pub fn size(&self) -> Option<usize> {
        Some(match self {
            Dtype::F64 | Dtype::I64 => 8,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F16 | Dtype::Bf16 | Dtype::I16 => 2,
            Dtype::I8 | Dtype::U8 | Dtype::Bool | Dtype::F8E4m3 => 1,
            Dtype::Other(_) => return None,
        })
    }
    /// The float element type a weight sink takes, for the float dtypes.
    pub fn source(&self) -> Option<crate::backend::SourceDtype> {
        use crate::backend::SourceDtype as S;
        Some(match self {
            Dtype::F64 => S::F64,
            Dtype::F32 => S::F32,
            Dtype::F16 => S::F16,
            Dtype::Bf16 => S::Bf16,
            Dtype::F8E4m3 => S::F8E4m3,
            _ => return None,
        })
    }
    fn to_crate(&self) -> Option<safetensors::Dtype> {
        use safetensors::Dtype as D;
        Some(match self {
            Dtype::F64 => D::F64,
            Dtype::F32 => D::F32,
            Dtype::F16 => D::F16,
            Dtype::Bf16 => D::BF16,
            Dtype::I64 => D::I64,
            Dtype::I32 => D::I32,
            Dtype::I16 => D::I16,
            Dtype::I8 => D::I8,
            Dtype::U8 => D::U8,
            Dtype::Bool => D::BOOL,
            Dtype::F8E4m3 => D::F8_E4M3,
            Dtype::Other(_) => return None,
        })
    }
}

/// Where one tensor lies in a parsed file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The bytes behind a parsed file.
enum Backing {
    Owned(Vec<u8>),
    Mapped(memmap2::Mmap),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Owned(v) => v,
            Backing::Mapped(m) => m,
        }
    }
}

/// A parsed safetensors file (the bytes, owned or mapped, plus a validated index).
pub struct SafeTensors {
    /// File name, for messages.
    pub origin: String,
    /// The file, for a mapped one.
    path: Option<std::path::PathBuf>,
    bytes: Backing,
    pub tensors: BTreeMap<String, TensorInfo>,
    pub metadata: BTreeMap<String, String>,
}

fn corrupt(origin: &str, msg: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{origin}: {msg}"))
}

impl SafeTensors {
    /// Map and validate a file. Only the header is read now; data pages come in as they are
    /// touched.
    pub fn open(path: &Path) -> Result<SafeTensors> {
        let io = |e| Error::Io {
            path: path.display().to_string(),
            source: e,
        };
        // Look before opening: opening a FIFO for reading would block.
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(corrupt(&path.display().to_string(), "not a regular file"));
        }
        // An empty file cannot be mapped; the parser gives it its proper error.
        if meta.len() == 0 {
            return SafeTensors::parse(Vec::new(), &path.display().to_string());
        }
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private. Checkpoint files are not expected to change
        // while a model loads; if one is truncated underneath us, reads past the new end fault
        // (SIGBUS), which is the documented hazard of mapping files, as in every runtime that
        // maps weights.
        let map = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(io)?;
        #[cfg(unix)]
        let _ = map.advise(memmap2::Advice::Sequential);
        let mut st = SafeTensors::from_backing(Backing::Mapped(map), &path.display().to_string())?;
        st.path = Some(path.to_path_buf());
        Ok(st)
    }

    /// [`SafeTensors::open`] (kept for callers that read small files such as references).
    pub fn read(path: &Path) -> Result<SafeTensors> {
        SafeTensors::open(path)
    }

    /// Validate `bytes` as a safetensors file.
    pub fn parse(bytes: Vec<u8>, origin: &str) -> Result<SafeTensors> {
        SafeTensors::from_backing(Backing::Owned(bytes), origin)
    }

    fn from_backing(bytes: Backing, origin: &str) -> Result<SafeTensors> {
        let buf = bytes.bytes();
        let (n, meta) = safetensors::SafeTensors::read_metadata(buf)
            .map_err(|e| corrupt(origin, explain(buf, &e)))?;
        let data_start = 8 + n;
        let mut tensors = BTreeMap::new();
        for (name, info) in meta.tensors() {
            let (begin, end) = info.data_offsets;
            tensors.insert(
                name,
                TensorInfo {
                    dtype: Dtype::parse(&format!("{:?}", info.dtype)),
                    shape: info.shape.clone(),
                    start: data_start + begin,
                    end: data_start + end,
                },
            );
        }
        let metadata = meta
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        Ok(SafeTensors {
            origin: origin.to_string(),
            path: None,
            bytes,
            tensors,
            metadata,
        })
    }

    /// Total bytes of the file.
    pub fn len(&self) -> usize {
        self.bytes.bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Bytes `range` of the file (a tensor's `start..end`, or part of it).
    pub fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.bytes.bytes()[range]
    }

    /// The raw bytes of a tensor.
    pub fn data(&self, name: &str) -> Result<&[u8]> {
        let t = self
            .info(name)
            .ok_or_else(|| corrupt(&self.origin, format!("no tensor `{name}`")))?;
        Ok(&self.bytes.bytes()[t.start..t.end])
    }

    /// The file a mapped `SafeTensors` was opened from.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Drop the pages of `range` from this process (they stay in the page cache), so a long
    /// streaming read keeps the resident set flat. No-op for owned bytes. Only whole pages
    /// inside the range are dropped; the next access of a dropped page reads it again.
    pub fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let Backing::Mapped(m) = &self.bytes
            && let Some((off, len)) = page_range(range, m.len())
        {
            // SAFETY: the mapping is a read-only private map of a file, never written through;
            // MADV_DONTNEED only discards this process's page table entries for the range, and
            // later reads fault the same file contents back in. No reference into the range
            // is used in a way that depends on the pages staying resident.
            let _ =
                unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, off, len) };
        }
        #[cfg(not(unix))]
        let _ = range;
    }

    /// A float tensor converted to f32 (F32, F16, BF16, F64).
    pub fn f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .info(name)
            .ok_or_else(|| corrupt(&self.origin, format!("no tensor `{name}`")))?;
        let b = &self.bytes.bytes()[t.start..t.end];
        to_f32(&t.dtype, b).ok_or_else(|| {
            corrupt(
                &self.origin,
                format!(
                    "tensor `{name}` has dtype {} (expected F32, F16, BF16 or F64)",
                    t.dtype.name()
                ),
            )
        })
    }

    /// An integer tensor as i64 (I64, I32, I16, I8, U8).
    pub fn i64(&self, name: &str) -> Result<Vec<i64>> {
        let t = self
            .info(name)
            .ok_or_else(|| corrupt(&self.origin, format!("no tensor `{name}`")))?;
        let b = &self.bytes.bytes()[t.start..t.end];
        Ok(match t.dtype {
            Dtype::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8")))
                .collect(),
            Dtype::I32 => b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("4")) as i64)
                .collect(),
            Dtype::I16 => b
                .chunks_exact(2)
                .map(|c| i16::from_le_bytes(c.try_into().expect("2")) as i64)
                .collect(),
            Dtype::I8 => b.iter().map(|&x| x as i8 as i64).collect(),
            Dtype::U8 => b.iter().map(|&x| x as i64).collect(),
            ref d => {
                return Err(corrupt(
                    &self.origin,
                    format!(
                        "tensor `{name}` has dtype {} (expected an integer type)",
                        d.name()
                    ),
                ));
            }
        })
    }
}

/// The whole pages inside `range` within a map of `len` bytes.
#[cfg(unix)]
fn page_range(range: std::ops::Range<usize>, len: usize) -> Option<(usize, usize)> {
    const PAGE: usize = 4096;
    let end = range.end.min(len);
    let (start, end) = (range.start.div_ceil(PAGE) * PAGE, end / PAGE * PAGE);
    (end > start).then(|| (start, end - start))
}

/// The crate's error in this project's words, with the offending tensor named where the
/// crate does not name it (a byte size that does not match shape and dtype).
fn explain(buf: &[u8], e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall | E::InvalidHeaderLength | E::HeaderTooLarge => {
            let n = buf
                .get(..8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
            match n {
                None => format!(
                    "file is {} bytes, shorter than the 8-byte header length",
                    buf.len()
                ),
                Some(n) => format!(
                    "header length {n} does not fit the {} bytes after it (truncated or not a safetensors file)",
                    buf.len() - 8
                ),
            }
        }
        E::InvalidHeader(_) => format!("header is not UTF-8: {e}"),
        E::InvalidHeaderDeserialization(_) => format!("header is not a valid tensor index: {e}"),
        E::InvalidOffset(name) => format!(
            "tensor `{name}`: data_offsets do not follow the previous tensor (overlapping, out of order or out of range)"
        ),
        E::MetadataIncompleteBuffer => {
            "the tensors' data does not end where the file ends (truncated, or trailing bytes)"
                .to_string()
        }
        E::TensorInvalidInfo => match misfit(buf) {
            Some(name) => format!(
                "tensor `{name}`: byte size does not match its shape and dtype (wrong dtype size or corrupt offsets)"
            ),
            None => format!("{e} (wrong dtype size or corrupt offsets)"),
        },
        other => other.to_string(),
    }
}

/// The first tensor whose byte range does not hold shape x dtype bytes (for messages only).
fn misfit(buf: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value =
        serde_json::from_slice(buf.get(8..8usize.checked_add(n)?)?).ok()?;
    for (name, v) in header.as_object()? {
        if name == "__metadata__" {
            continue;
        }
        let size = Dtype::parse(v.get("dtype")?.as_str()?).size()?;
        let numel: u64 = v
            .get("shape")?
            .as_array()?
            .iter()
            .map(|d| d.as_u64())
            .product::<Option<u64>>()?;
        let offs = v.get("data_offsets")?.as_array()?;
        let (a, b) = (offs.first()?.as_u64()?, offs.get(1)?.as_u64()?);
        if b.checked_sub(a) != numel.checked_mul(size as u64) {
            return Some(name.clone());
        }
    }
    None
}

/// Convert little-endian float bytes to f32; `None` for non-float dtypes.
pub fn to_f32(dtype: &Dtype, b: &[u8]) -> Option<Vec<f32>> {
    let src = dtype.source()?;
    let mut out = vec![0f32; b.len() / src.size()];
    src.to_f32(b, &mut out);
    Some(out)
}

/// One tensor to write.
pub struct TensorOut<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

impl safetensors::View for &TensorOut<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
            .to_crate()
            .expect("serialize checks the dtype first")
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Serialise tensors into safetensors bytes (the crate orders them by dtype alignment, then
/// name). Panics if a tensor's bytes do not match its shape and dtype, or its dtype is not
/// one this module names: callers build these from their own data.
pub fn serialize(tensors: &[TensorOut<'_>], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    for t in tensors {
        assert!(
            t.dtype.to_crate().is_some(),
            "cannot write tensor `{}` of dtype {}",
            t.name,
            t.dtype.name()
        );
    }
    let info = (!metadata.is_empty()).then(|| {
        metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    });
    safetensors::serialize(tensors.iter().map(|t| (t.name, t)), info)
        .unwrap_or_else(|e| panic!("serialize: {e}"))
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    f32_bytes_into(v, Vec::new())
}

/// [`f32_bytes`] into `buf` (its old contents dropped, its capacity reused).
pub fn f32_bytes_into(v: &[f32], mut buf: Vec<u8>) -> Vec<u8> {
    buf.clear();
    buf.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    buf
}

/// Little-endian bytes as f32 values (trailing bytes ignored).
pub fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let a = f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let ids: Vec<u8> = [7i64, 9].iter().flat_map(|x| x.to_le_bytes()).collect();
        serialize(
            &[
                TensorOut {
                    name: "a",
                    dtype: Dtype::F32,
                    shape: vec![2, 3],
                    data: &a,
                },
                TensorOut {
                    name: "ids",
                    dtype: Dtype::I64,
                    shape: vec![2],
                    data: &ids,
                },
            ],
            &BTreeMap::new(),
        )
    }

    /// A file with one F32 tensor `t` of shape [3] whose header claims `bytes` bytes.
    fn with_size(bytes: usize) -> Vec<u8> {
        let h = format!(r#"{{"t":{{"dtype":"F32","shape":[3],"data_offsets":[0,{bytes}]}}}}"#);
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(h.as_bytes());
        out.extend(std::iter::repeat_n(0u8, bytes));
        out
    }

    #[test]
    fn roundtrip() {
        let st = SafeTensors::parse(sample(), "mem").unwrap();
        assert_eq!(st.f32("a").unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(st.i64("ids").unwrap(), vec![7, 9]);
        assert_eq!(st.info("a").unwrap().shape, vec![2, 3]);
        assert!(st.f32("ids").is_err());
        assert!(st.f32("missing").is_err());
    }

    #[test]
    fn mapped_files_read_like_owned_ones() {
        let dir = std::env::temp_dir().join(format!("flashrt-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.safetensors");
        std::fs::write(&p, sample()).unwrap();
        let st = SafeTensors::open(&p).unwrap();
        assert_eq!(st.path(), Some(p.as_path()));
        assert_eq!(st.f32("a").unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        // Released pages read back the same bytes.
        st.release(0..st.len());
        assert_eq!(st.f32("a").unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        std::fs::write(dir.join("empty.safetensors"), b"").unwrap();
        let e = SafeTensors::open(&dir.join("empty.safetensors"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("shorter than the 8-byte header"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn corrupt_files_are_errors() {
        let good = sample();
        // Truncated at every length: never a panic, always an error.
        for cut in 0..good.len() {
            let r = SafeTensors::parse(good[..cut].to_vec(), "cut");
            assert!(r.is_err(), "truncation at {cut} accepted");
        }
        // Absurd header length.
        let mut b = good.clone();
        b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = SafeTensors::parse(b, "x").err().unwrap().to_string();
        assert!(
            e.contains("header length") && e.starts_with("invalid checkpoint: x:"),
            "{e}"
        );
        // Bad JSON.
        let mut b = good.clone();
        b[8] = b'[';
        b[9] = b'{';
        assert!(SafeTensors::parse(b, "x").is_err());
        // Wrong dtype size: F32 header over 2-byte elements names the tensor.
        let e = SafeTensors::parse(with_size(6), "x")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("tensor `t`") && e.contains("wrong dtype size"),
            "{e}"
        );
        assert!(SafeTensors::parse(with_size(12), "x").is_ok());
        // Trailing garbage after the last tensor.
        let mut b = with_size(12);
        b.push(0);
        let e = SafeTensors::parse(b, "x").err().unwrap().to_string();
        assert!(e.contains("does not end where the file ends"), "{e}");
    }
}
