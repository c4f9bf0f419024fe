//! A small, strict reader (and writer) of the safetensors format.
//!
//! Layout of a file: an 8-byte little-endian header length `n`, `n` bytes of JSON
//! (`{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}`),
//! then the data, with offsets relative to the end of the header. Every file is treated as
//! untrusted: header length, JSON, dtypes, shapes and offsets are all checked, and any defect
//! is an [`Error::Checkpoint`] naming the file and the tensor, never a panic.

use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// Headers larger than this are rejected (real headers are a few MB at most).
const MAX_HEADER: u64 = 256 << 20;

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
    /// A dtype this reader does not convert (fp8 variants, ...); usable only if unused.
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
            Dtype::Other(s) => s,
        }
    }
    /// Bytes per element; `None` for dtypes whose size this reader does not know.
    pub fn size(&self) -> Option<usize> {
        Some(match self {
            Dtype::F64 | Dtype::I64 => 8,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F16 | Dtype::Bf16 | Dtype::I16 => 2,
            Dtype::I8 | Dtype::U8 | Dtype::Bool => 1,
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

/// A parsed safetensors file (the bytes plus a validated index).
pub struct SafeTensors {
    /// File name, for messages.
    pub origin: String,
    bytes: Vec<u8>,
    pub tensors: BTreeMap<String, TensorInfo>,
    pub metadata: BTreeMap<String, String>,
}

fn corrupt(origin: &str, msg: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{origin}: {msg}"))
}

impl SafeTensors {
    /// Read and validate a file.
    pub fn read(path: &std::path::Path) -> Result<SafeTensors> {
        let bytes = std::fs::read(path).map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        SafeTensors::parse(bytes, &path.display().to_string())
    }

    /// Validate `bytes` as a safetensors file.
    pub fn parse(bytes: Vec<u8>, origin: &str) -> Result<SafeTensors> {
        if bytes.len() < 8 {
            return Err(corrupt(
                origin,
                format!(
                    "file is {} bytes, shorter than the 8-byte header length",
                    bytes.len()
                ),
            ));
        }
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        let avail = (bytes.len() - 8) as u64;
        if n > avail || n > MAX_HEADER {
            return Err(corrupt(
                origin,
                format!(
                    "header length {n} exceeds the {avail} bytes after it (truncated or not a safetensors file)"
                ),
            ));
        }
        let n = n as usize;
        let header = std::str::from_utf8(&bytes[8..8 + n])
            .map_err(|e| corrupt(origin, format!("header is not UTF-8: {e}")))?;
        let json: Value = serde_json::from_str(header.trim_end())
            .map_err(|e| corrupt(origin, format!("header is not valid JSON: {e}")))?;
        let Value::Object(entries) = json else {
            return Err(corrupt(origin, "header is not a JSON object"));
        };
        let data_start = 8 + n;
        let data_len = bytes.len() - data_start;
        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, v) in &entries {
            if name == "__metadata__" {
                if let Value::Object(m) = v {
                    for (k, v) in m {
                        if let Some(s) = v.as_str() {
                            metadata.insert(k.clone(), s.to_string());
                        }
                    }
                }
                continue;
            }
            let info = parse_entry(origin, name, v, data_len)?;
            tensors.insert(
                name.clone(),
                TensorInfo {
                    start: info.start + data_start,
                    end: info.end + data_start,
                    ..info
                },
            );
        }
        Ok(SafeTensors {
            origin: origin.to_string(),
            bytes,
            tensors,
            metadata,
        })
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The raw bytes of a tensor.
    pub fn data(&self, name: &str) -> Result<&[u8]> {
        let t = self
            .info(name)
            .ok_or_else(|| corrupt(&self.origin, format!("no tensor `{name}`")))?;
        Ok(&self.bytes[t.start..t.end])
    }

    /// A float tensor converted to f32 (F32, F16, BF16, F64).
    pub fn f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .info(name)
            .ok_or_else(|| corrupt(&self.origin, format!("no tensor `{name}`")))?;
        let b = &self.bytes[t.start..t.end];
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
        let b = &self.bytes[t.start..t.end];
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

fn parse_entry(origin: &str, name: &str, v: &Value, data_len: usize) -> Result<TensorInfo> {
    let bad = |msg: &str| corrupt(origin, format!("tensor `{name}`: {msg}"));
    let Value::Object(m) = v else {
        return Err(bad("entry is not an object"));
    };
    let dtype = Dtype::parse(
        m.get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("missing or non-string `dtype`"))?,
    );
    let shape = m
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("missing or non-list `shape`"))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| bad("`shape` holds a non-integer"))?;
    let offs = m
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
        .ok_or_else(|| bad("`data_offsets` is not a pair of integers"))?;
    let (begin, end) = offs;
    if begin > end || end > data_len as u64 {
        return Err(bad(&format!(
            "data_offsets [{begin}, {end}] out of range (data section is {data_len} bytes)"
        )));
    }
    let (begin, end) = (begin as usize, end as usize);
    let numel = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad("shape overflows"))?;
    if let Some(size) = dtype.size() {
        let want = numel
            .checked_mul(size)
            .ok_or_else(|| bad("shape overflows"))?;
        if want != end - begin {
            return Err(bad(&format!(
                "{} bytes for shape {shape:?} of {} ({want} expected): wrong dtype size or corrupt offsets",
                end - begin,
                dtype.name()
            )));
        }
    }
    Ok(TensorInfo {
        dtype,
        shape,
        start: begin,
        end,
    })
}

/// Convert little-endian float bytes to f32; `None` for non-float dtypes.
pub fn to_f32(dtype: &Dtype, b: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().expect("2")).to_f32())
            .collect(),
        Dtype::Bf16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes(c.try_into().expect("2")).to_f32())
            .collect(),
        Dtype::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8")) as f32)
            .collect(),
        _ => return None,
    })
}

/// One tensor to write.
pub struct TensorOut<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

/// Serialise tensors (in the given order) into safetensors bytes.
pub fn serialize(tensors: &[TensorOut<'_>], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        let m: Map<String, Value> = metadata
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        header.insert("__metadata__".into(), Value::Object(m));
    }
    let mut off = 0usize;
    for t in tensors {
        let mut e = Map::new();
        e.insert("dtype".into(), Value::String(t.dtype.name().to_string()));
        e.insert(
            "shape".into(),
            Value::Array(t.shape.iter().map(|&d| Value::from(d)).collect()),
        );
        e.insert(
            "data_offsets".into(),
            Value::Array(vec![Value::from(off), Value::from(off + t.data.len())]),
        );
        header.insert(t.name.to_string(), Value::Object(e));
        off += t.data.len();
    }
    let mut h = Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + off);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for t in tensors {
        out.extend_from_slice(t.data);
    }
    out
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
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
        assert!(
            SafeTensors::parse(b, "x")
                .err()
                .unwrap()
                .to_string()
                .contains("header length")
        );
        // Bad JSON.
        let mut b = good.clone();
        b[8] = b'[';
        b[9] = b'{';
        assert!(SafeTensors::parse(b, "x").is_err());
        // Wrong dtype size: F32 header over 2-byte elements.
        let data = [0u8; 6];
        let bytes = serialize(
            &[TensorOut {
                name: "t",
                dtype: Dtype::F32,
                shape: vec![3],
                data: &data,
            }],
            &BTreeMap::new(),
        );
        let e = SafeTensors::parse(bytes, "x").err().unwrap().to_string();
        assert!(e.contains("wrong dtype size"), "{e}");
    }
}
