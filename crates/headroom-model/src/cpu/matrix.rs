//! Weight matrices kept in their file's block layout, and their products with activations.

use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use super::dot::{activation_kind, quantize_q8x256, quantize_q8x32, ActivationKind, Kernels, Q8x256, Q8x32};
use crate::quants::GgmlType;

/// A matrix's bytes: a range of a memory-mapped model file (no copy; the page cache holds it
/// once however many workers map it) or memory of our own (converted weights).
pub enum Bytes {
    Mapped { map: Arc<memmap2::Mmap>, start: usize, len: usize },
    Owned(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, start, len } => &map[*start..*start + *len],
            Bytes::Owned(v) => v,
        }
    }
}

/// `rows × cols` weights, row-major, each row a whole number of `ty` blocks: the layout GGUF
/// stores (`[out, in]`), so a product reads every row once, front to back.
pub struct PackedMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    data: Bytes,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedMatrix({} {}×{})", self.ty, self.rows, self.cols)
    }
}

impl PackedMatrix {
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Bytes) -> Result<Self, String> {
        if activation_kind(ty).is_none() {
            return Err(format!("{ty} weights are not kept packed on the CPU"));
        }
        let block = ty.block_elements();
        if cols % block != 0 {
            return Err(format!("a row of {cols} values is not a whole number of {ty} blocks of {block}"));
        }
        let row_bytes = cols / block * ty.block_bytes();
        if data.len() != rows * row_bytes {
            return Err(format!("{rows}×{cols} {ty} weights need {} bytes, found {}", rows * row_bytes, data.len()));
        }
        Ok(Self { ty, rows, cols, row_bytes, data })
    }

    /// f32 weights `[rows, cols]` held in memory of our own.
    pub fn from_f32(values: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(values.len(), rows * cols);
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(GgmlType::F32, rows, cols, Bytes::Owned(bytes)).expect("f32 rows always fit")
    }

    /// Q8_0 weights quantized from f32 (for types the CPU does not multiply packed).
    pub fn q8_0_from_f32(values: &[f32], rows: usize, cols: usize) -> Self {
        Self::new(GgmlType::Q8_0, rows, cols, Bytes::Owned(crate::quants::quantize_q8_0(values))).expect("whole Q8_0 blocks")
    }

    pub fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        crate::quants::dequantize(self.ty, self.row(r), self.cols).expect("row sizes were checked at construction")
    }

    /// Bytes this matrix occupies (mapped or owned).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// `out[t · rows + r] = row r · activation t` for every token `t` of `x` and every row `r`.
    pub fn multiply(&self, x: &Activations, out: &mut [f32]) {
        multiply_all(&mut [(self, out)], x);
    }

    /// `dot(r, t, out)`: rows `r..r + out.len()` (at most 4) times activation `t`.
    #[allow(clippy::type_complexity)]
    fn rows_dot<'s>(&'s self, x: &'s Activations) -> Box<dyn Fn(usize, usize, &mut [f32]) + Sync + 's> {
        assert_eq!(x.cols, self.cols, "activations have {} columns, the weights {}", x.cols, self.cols);
        let kernels = Kernels::detect();
        let rb = self.row_bytes;
        let rows = move |r: usize, n: usize| &self.data[r * rb..(r + n) * rb];
        match activation_kind(self.ty).expect("checked at construction") {
            ActivationKind::F32 => {
                let f = if self.ty == GgmlType::F32 { kernels.f32_rows } else { kernels.f16_rows };
                Box::new(move |r, t, out| f(rows(r, out.len()), rb, x.row_f32(t), out))
            }
            ActivationKind::Q8x32 => {
                let f = match self.ty {
                    GgmlType::Q4_0 => kernels.q4_0,
                    GgmlType::Q4_1 => kernels.q4_1,
                    _ => kernels.q8_0,
                };
                let q = x.q8x32();
                let per = self.cols / 32;
                Box::new(move |r, t, out| f(rows(r, out.len()), rb, &q[t * per..(t + 1) * per], out))
            }
            ActivationKind::Q8x256 => {
                let f = match self.ty {
                    GgmlType::Q4K => kernels.q4_k,
                    GgmlType::Q5K => kernels.q5_k,
                    _ => kernels.q6_k,
                };
                let q = x.q8x256();
                let per = self.cols / 256;
                Box::new(move |r, t, out| f(rows(r, out.len()), rb, &q[t * per..(t + 1) * per], out))
            }
        }
    }
}

/// Several products of the same activations (q, k and v; gate and up) in one parallel region:
/// one hand-off to the threads instead of one per matrix, which at decode (a few microseconds of
/// work per matrix) costs as much as the work.
pub fn multiply_all(products: &mut [(&PackedMatrix, &mut [f32])], x: &Activations) {
    let tokens = x.rows;
    let mut tasks = Vec::new();
    let mut dots = Vec::with_capacity(products.len());
    for (i, (m, out)) in products.iter_mut().enumerate() {
        assert_eq!(out.len(), tokens * m.rows);
        dots.push((m.rows_dot(x), SharedOut(out.as_mut_ptr()), m.rows));
        let tile = tile_rows(m.rows, tokens, m.cols);
        tasks.extend((0..m.rows.div_ceil(tile)).map(|k| (i, k * tile, ((k + 1) * tile).min(m.rows))));
    }
    // Rows are split into tiles over the threads; within a tile every token reads the tile's
    // rows while they are in cache.
    let run = |&(i, first, last): &(usize, usize, usize)| {
        let (dot, out, rows) = &dots[i];
        for t in 0..tokens {
            let mut r = first;
            while r < last {
                let n = (last - r).min(4);
                // SAFETY: rows r..r + n of token t belong to this task alone, inside product i's `out`.
                dot(r, t, unsafe { out.slice(t * rows + r, n) });
                r += n;
            }
        }
    };
    if tasks.len() == 1 || rayon::current_num_threads() == 1 {
        tasks.iter().for_each(run);
    } else {
        tasks.par_iter().for_each(run);
    }
}

/// Rows per task: enough work per task to pay for handing it out, and enough tasks to keep
/// every thread busy to the end.
fn tile_rows(rows: usize, tokens: usize, cols: usize) -> usize {
    const MIN_WORK: usize = 64 * 1024;
    let threads = rayon::current_num_threads().max(1);
    let by_work = MIN_WORK.div_ceil(cols * tokens).max(1);
    let by_balance = rows.div_ceil(threads * 4).max(1);
    // Prefill tiles stay small enough for the tile's rows to sit in the L1/L2 cache.
    let by_cache = if tokens > 1 { (64 * 1024 / cols.max(1)).max(4) } else { rows };
    by_work.max(by_balance.min(by_cache)).min(rows.max(1))
}

#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}
impl SharedOut {
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

/// `rows` activation vectors of `cols` values, quantized on first use to the form a weight type
/// multiplies with (once per form, however many matrices read them).
pub struct Activations<'a> {
    values: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    q32: OnceLock<Vec<Q8x32>>,
    q256: OnceLock<Vec<Q8x256>>,
}

impl<'a> Activations<'a> {
    pub fn new(values: &'a [f32], rows: usize, cols: usize) -> Self {
        assert_eq!(values.len(), rows * cols);
        Self { values, rows, cols, q32: OnceLock::new(), q256: OnceLock::new() }
    }

    fn row_f32(&self, t: usize) -> &[f32] {
        &self.values[t * self.cols..(t + 1) * self.cols]
    }

    fn q8x32(&self) -> &[Q8x32] {
        self.q32.get_or_init(|| {
            let mut q = vec![Q8x32::default(); self.values.len() / 32];
            let per = self.cols / 32;
            q.par_chunks_mut(per).zip(self.values.par_chunks(self.cols)).for_each(|(q, x)| quantize_q8x32(x, q));
            q
        })
    }

    fn q8x256(&self) -> &[Q8x256] {
        self.q256.get_or_init(|| {
            let mut q = vec![Q8x256::default(); self.values.len() / 256];
            let per = self.cols / 256;
            q.par_chunks_mut(per).zip(self.values.par_chunks(self.cols)).for_each(|(q, x)| quantize_q8x256(x, q));
            q
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::dot::Kernels;

    /// Products over odd row counts (groups of four and a remainder) and several tokens equal
    /// the scalar reference row by row, for packed and f32 weights.
    #[test]
    fn products_with_odd_row_counts_equal_the_reference() {
        let (rows, cols, tokens) = (7, 256, 3);
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1).collect();
        let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 2.0).collect();
        for m in [PackedMatrix::q8_0_from_f32(&values, rows, cols), PackedMatrix::from_f32(&values, rows, cols)] {
            let mut out = vec![0f32; tokens * rows];
            m.multiply(&Activations::new(&x, tokens, cols), &mut out);
            for t in 0..tokens {
                let xt = &x[t * cols..(t + 1) * cols];
                let reference = if m.ty == GgmlType::F32 {
                    (0..rows).map(|r| { let mut o = [0f32]; (Kernels::SCALAR.f32_rows)(m.row(r), m.row_bytes, xt, &mut o); o[0] }).collect::<Vec<_>>()
                } else {
                    let mut q = vec![crate::cpu::dot::Q8x32::default(); cols / 32];
                    crate::cpu::dot::quantize_q8x32(xt, &mut q);
                    (0..rows).map(|r| { let mut o = [0f32]; (Kernels::SCALAR.q8_0)(m.row(r), m.row_bytes, &q, &mut o); o[0] }).collect::<Vec<_>>()
                };
                for (r, want) in reference.iter().enumerate() {
                    let got = out[t * rows + r];
                    assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{} token {t} row {r}: {got} vs {want}", m.ty);
                }
            }
        }
    }
}
