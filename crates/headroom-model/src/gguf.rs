//! GGUF files (llama.cpp's format, versions 2 and 3), memory-mapped: the metadata, the tensor
//! directory, and each tensor's bytes. Every read is bounds-checked so a truncated or corrupt file
//! is an error naming the file and the problem, never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::quants::GgmlType;
use crate::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer value that fits, as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Row-major shape, outermost first (GGUF lists dimensions innermost first; this is reversed).
    pub shape: Vec<usize>,
    pub ggml_type: GgmlType,
    /// Byte offset of the data from the start of the file.
    pub offset: usize,
    pub bytes: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An open GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorInfo>,
    pub(crate) map: std::sync::Arc<memmap2::Mmap>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

/// A bounds-checked little-endian reader over the mapped file.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            format!(
                "is truncated: reading {what} needs {n} bytes at offset {} but the file has {}",
                self.pos,
                self.bytes.len()
            )
        })?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> std::result::Result<[u8; N], String> {
        Ok(self.take(N, what)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that must be plausible for what remains of the file (each item at least
    /// `min_item_bytes`), so a corrupt count fails here instead of allocating terabytes.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> std::result::Result<usize, String> {
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n.saturating_mul(min_item_bytes.max(1) as u64) > left {
            return Err(format!("is truncated or corrupt: {what} is {n}, more than the {left} bytes left could hold"));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> std::result::Result<String, String> {
        let len = self.count(what, 1)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("is corrupt: {what} is not UTF-8"))
    }

    fn value(&mut self, kind: u32, key: &str, depth: usize) -> std::result::Result<Value, String> {
        Ok(match kind {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => Value::Bool(self.array::<1>(key)?[0] != 0),
            8 => Value::String(self.string(key)?),
            9 if depth == 0 => {
                let item_kind = self.u32(key)?;
                let n = self.count(key, 1)?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(item_kind, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            other => return Err(format!("is corrupt: metadata `{key}` has unknown value type {other}")),
        })
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let fail = |reason: String| Error::Gguf { path: path.display().to_string(), reason };
        let file = std::fs::File::open(&path).map_err(|e| fail(format!("cannot be opened: {e}")))?;
        // SAFETY: opened read-only; a model file is not modified while it is served.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| fail(format!("cannot be mapped: {e}")))?;
        Self::parse(path.clone(), map).map_err(fail)
    }

    fn parse(path: PathBuf, map: memmap2::Mmap) -> std::result::Result<Self, String> {
        let mut r = Reader { bytes: &map, pos: 0 };
        let magic = r.array::<4>("the magic")?;
        if &magic != MAGIC {
            return Err(format!(
                "is not a GGUF file (it starts with {:?}, not \"GGUF\"); pass a .gguf model file or a Hugging Face folder",
                String::from_utf8_lossy(&magic)
            ));
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(format!(
                "is GGUF version {version}; Headroom reads versions 2 and 3 (re-convert it with a current llama.cpp)"
            ));
        }
        let tensor_count = r.count("the tensor count", 24)?;
        let kv_count = r.count("the metadata count", 12)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = r.string("a metadata key")?;
            let kind = r.u32(&key)?;
            let value = r.value(kind, &key, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v.as_u64().filter(|a| a.is_power_of_two()).ok_or_else(|| {
                format!("is corrupt: general.alignment {v:?} is not a power of two")
            })?,
        };
        let mut raw = Vec::with_capacity(tensor_count);
        for _ in 0..tensor_count {
            let name = r.string("a tensor name")?;
            let n_dims = r.u32(&name)? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(format!("is corrupt: tensor `{name}` has {n_dims} dimensions (1 to 4 allowed)"));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                let d = r.u64(&name)?;
                dims.push(usize::try_from(d).map_err(|_| format!("is corrupt: tensor `{name}` dimension {d}"))?);
            }
            dims.reverse();
            let type_id = r.u32(&name)?;
            let offset = r.u64(&name)?;
            raw.push((name, dims, type_id, offset));
        }
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = map.len() as u64;
        let mut tensors = BTreeMap::new();
        for (name, shape, type_id, offset) in raw {
            let ggml_type = GgmlType::from_id(type_id).map_err(|e| format!("has tensor `{name}` of {e}"))?;
            let elements = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
            let elements = elements.ok_or_else(|| format!("is corrupt: tensor `{name}` shape {shape:?} overflows"))?;
            let row = *shape.last().expect("at least one dimension");
            if row % ggml_type.block_elements() != 0 {
                return Err(format!(
                    "is corrupt: tensor `{name}` ({ggml_type}) has rows of {row} values, not a multiple of its block of {}",
                    ggml_type.block_elements()
                ));
            }
            let bytes = elements / ggml_type.block_elements() * ggml_type.block_bytes();
            if offset % alignment != 0 {
                return Err(format!("is corrupt: tensor `{name}` starts at offset {offset}, not aligned to {alignment}"));
            }
            let start = data_start + offset;
            if start.checked_add(bytes as u64).is_none_or(|end| end > file_len) {
                return Err(format!(
                    "is truncated: tensor `{name}` ({shape:?}, {ggml_type}) needs {bytes} bytes at offset {start} \
                     but the file is {file_len} bytes; download it again"
                ));
            }
            let info = TensorInfo { name: name.clone(), shape, ggml_type, offset: start as usize, bytes };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(format!("is corrupt: tensor `{name}` appears twice"));
            }
        }
        Ok(Self { path, version, metadata, tensors, map: std::sync::Arc::new(map) })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn error(&self, reason: impl Into<String>) -> Error {
        Error::Gguf { path: self.path.display().to_string(), reason: reason.into() }
    }

    /// A required metadata value, or an error naming the key.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| self.error(format!("has no metadata `{key}`; the file is incomplete or not a language model")))
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| self.error(format!("metadata `{key}` is {v:?}, not an integer")))
    }

    pub fn string(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// A string array (tokens, merges).
    pub fn strings(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|items| items.iter().map(Value::as_str).collect::<Option<Vec<_>>>())
            .ok_or_else(|| self.error(format!("metadata `{key}` is not a list of strings")))
    }

    /// The raw bytes of a tensor (bounds were checked at open).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.offset..info.offset + info.bytes]
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| self.error(format!("has no tensor `{name}`; it is incomplete or of another architecture")))
    }

    /// A tensor as f32 values, dequantized, with its row-major shape.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let info = self.tensor(name)?;
        let values = crate::quants::dequantize(info.ggml_type, self.tensor_bytes(info), info.elements())
            .map_err(|e| self.error(format!("tensor `{name}`: {e}")))?;
        Ok((values, info.shape.clone()))
    }

    /// Bytes of tensor data per type, for the plan and the status.
    pub fn bytes_by_type(&self) -> BTreeMap<GgmlType, u64> {
        let mut out = BTreeMap::new();
        for info in self.tensors.values() {
            *out.entry(info.ggml_type).or_insert(0) += info.bytes as u64;
        }
        out
    }

    /// The type most of the weight bytes are stored in (what people call the file's quantization).
    pub fn dominant_type(&self) -> Option<GgmlType> {
        self.bytes_by_type().into_iter().max_by_key(|&(_, bytes)| bytes).map(|(t, _)| t)
    }
}

/// Writes a GGUF v3 file: for tests and fixtures (the `gguf` Python package is the independent
/// writer the reference tests use).
pub fn write(
    path: &Path,
    metadata: &[(&str, Value)],
    tensors: &[(String, Vec<usize>, GgmlType, Vec<u8>)],
) -> Result<()> {
    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    fn put_value(out: &mut Vec<u8>, v: &Value, with_kind: bool) {
        let (kind, body): (u32, Vec<u8>) = match v {
            Value::U8(x) => (0, vec![*x]),
            Value::I8(x) => (1, vec![*x as u8]),
            Value::U16(x) => (2, x.to_le_bytes().to_vec()),
            Value::I16(x) => (3, x.to_le_bytes().to_vec()),
            Value::U32(x) => (4, x.to_le_bytes().to_vec()),
            Value::I32(x) => (5, x.to_le_bytes().to_vec()),
            Value::F32(x) => (6, x.to_le_bytes().to_vec()),
            Value::Bool(x) => (7, vec![*x as u8]),
            Value::String(s) => {
                let mut b = Vec::new();
                put_str(&mut b, s);
                (8, b)
            }
            Value::Array(items) => {
                let mut b = Vec::new();
                let item_kind = items.first().map(kind_of).unwrap_or(4);
                b.extend(item_kind.to_le_bytes());
                b.extend((items.len() as u64).to_le_bytes());
                for item in items {
                    put_value(&mut b, item, false);
                }
                (9, b)
            }
            Value::U64(x) => (10, x.to_le_bytes().to_vec()),
            Value::I64(x) => (11, x.to_le_bytes().to_vec()),
            Value::F64(x) => (12, x.to_le_bytes().to_vec()),
        };
        if with_kind {
            out.extend(kind.to_le_bytes());
        }
        out.extend(body);
    }
    fn kind_of(v: &Value) -> u32 {
        match v {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
    let mut out = Vec::new();
    out.extend(MAGIC);
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        put_str(&mut out, key);
        put_value(&mut out, value, true);
    }
    let mut offset = 0u64;
    for (name, shape, ggml_type, bytes) in tensors {
        put_str(&mut out, name);
        out.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend((*ggml_type as u32).to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (bytes.len() as u64).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
    }
    out.resize(out.len().div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize, 0);
    for (_, _, _, bytes) in tensors {
        out.extend(bytes);
        out.resize(out.len().div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize, 0);
    }
    std::fs::write(path, out)?;
    Ok(())
}
