//! Weight matrices kept in their file's block layout, and their products with activations.

use std::cell::RefCell;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use super::dot::{activation_kind, quantize_q8x256, quantize_q8x32, ActivationKind, Kernels, Q8x256, Q8x32};
use super::interleave::{self, InterleavedKernel};
use super::interleave_k;
use super::team::Team;
use super::tile::{combine, combine32, unpack, unpack32, Combine, Combine32, FColumn16, FloatTileKernel, FloatUnpack, KBlock8, QBlock8, Tile32Kernel, TileKernel, FLOAT_ROWS, ROWS, TOKENS};
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
/// stores (`[out, in]`), so a product reads every row once, front to back; or, for Q4_0, Q4_1,
/// Q8_0, Q4_K, Q5_K and Q6_K where this processor has the kernel and the rows are whole groups of 16,
/// the same bytes repacked into those groups ([`super::interleave`], [`super::interleave_k`]).
pub struct PackedMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    data: Bytes,
    /// The kernel of repacked weights (`data` then holds records of 16 rows, not rows).
    interleaved: Option<Repacked>,
}

/// Weights repacked into groups of 16 rows, and their kernel.
#[derive(Clone, Copy)]
enum Repacked {
    /// Q4_0, Q4_1, Q8_0 ([`super::interleave`]).
    Blocks32(InterleavedKernel),
    /// Q4_K, Q5_K, Q6_K ([`super::interleave_k`]).
    Super256(interleave_k::Kernel),
}

impl Repacked {
    /// The repacking of `ty` that this processor has a kernel for, if any.
    fn of(ty: GgmlType) -> Option<Repacked> {
        let kernels = Kernels::detect();
        if interleave::record_bytes(ty).is_some() {
            kernels.interleaved32.map(Repacked::Blocks32)
        } else if interleave_k::record_bytes(ty).is_some() {
            kernels.interleaved256.map(Repacked::Super256)
        } else {
            None
        }
    }

    fn interleave(self, ty: GgmlType, w: &[u8], row_bytes: usize, out: &mut [u8]) {
        match self {
            Repacked::Blocks32(_) => interleave::interleave(ty, w, row_bytes, out),
            Repacked::Super256(_) => interleave_k::interleave(ty, w, row_bytes, out),
        }
    }
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
        let interleaved = Repacked::of(ty).filter(|_| rows % interleave::GROUP == 0);
        let data = match interleaved {
            Some(repacked) => {
                // A few groups at a time, each range of the file released once copied: the copy
                // never holds the whole matrix twice (resident memory peaks at the model's size).
                let mut records = vec![0u8; data.len()];
                let group = interleave::GROUP * row_bytes;
                let chunk = (1 << 20) / group.max(1) * group + group;
                for (at, out) in (0..data.len()).step_by(chunk).zip(records.chunks_mut(chunk)) {
                    repacked.interleave(ty, &data[at..at + out.len()], row_bytes, out);
                    release(&data, at, out.len());
                }
                Bytes::Owned(records)
            }
            None => data,
        };
        Ok(Self { ty, rows, cols, row_bytes, data, interleaved })
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

    /// Row `r`'s blocks as the file stores them.
    pub fn row(&self, r: usize) -> std::borrow::Cow<'_, [u8]> {
        match self.interleaved {
            Some(Repacked::Blocks32(_)) => interleave::row(self.ty, &self.data, self.row_bytes, r).into(),
            Some(Repacked::Super256(_)) => interleave_k::row(self.ty, &self.data, self.row_bytes, r).into(),
            None => self.data[r * self.row_bytes..(r + 1) * self.row_bytes].into(),
        }
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        crate::quants::dequantize(self.ty, &self.row(r), self.cols).expect("row sizes were checked at construction")
    }

    /// Whether the weights are repacked into groups of 16 rows ([`super::interleave`],
    /// [`super::interleave_k`]).
    pub fn is_interleaved(&self) -> bool {
        self.interleaved.is_some()
    }

    /// Bytes this matrix occupies (mapped or owned).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// `out[t · rows + r] = row r · activation t` for every token `t` of `x` and every row `r`.
    pub fn multiply(&self, x: &Activations, out: &mut [f32], team: &Team) {
        multiply_all(&mut [(self, out)], x, team);
    }

    /// `dot(r, t, tokens, out)`: rows `r..r + n` (at most 4) times activations `t..t + tokens`
    /// (1 or 2), into `out[k · n + i]` for token `t + k` and row `r + i`.
    #[allow(clippy::type_complexity)]
    fn rows_dot<'s>(&'s self, x: &'s Activations, team: &Team) -> RowsDot<'s> {
        let kernels = Kernels::detect();
        let rb = self.row_bytes;
        let rows = move |r: usize, n: usize| &self.data[r * rb..(r + n) * rb];
        match activation_kind(self.ty).expect("checked at construction") {
            ActivationKind::F32 => block_dot(rows, rb, x.values, self.cols, kernels.float_kernels(self.ty)),
            ActivationKind::Q8x32 => block_dot(rows, rb, x.q8x32(team), self.cols / 32, kernels.q8x32_kernels(self.ty)),
            ActivationKind::Q8x256 => block_dot(rows, rb, x.q8x256(team), self.cols / 256, kernels.q8x256_kernels(self.ty)),
        }
    }
}

/// Lets the kernel forget the pages of a mapped range once its weights are repacked: they stay
/// in the page cache, but no longer count in this process's resident memory twice. The range
/// reaches back over what the kernel's fault-around mapped again of the ranges released before
/// (up to 64 KiB around each fault).
fn release(data: &Bytes, at: usize, len: usize) {
    const FAULT_AROUND: usize = 256 << 10;
    if let Bytes::Mapped { map, start, .. } = data {
        let from = (start + at).saturating_sub(FAULT_AROUND);
        // SAFETY: the mapping is read-only and file-backed; a dropped page reads back from the
        // file unchanged if anything touches it again.
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, from, start + at + len - from) };
    }
}

/// [`PackedMatrix::rows_dot`] for a type multiplied with activations `A` (`per` of them per
/// token: quantized blocks, or f32 values for unquantized rows): two tokens go to the kernel that
/// reads each weight once for both.
#[allow(clippy::type_complexity)]
fn block_dot<'s, A: Sync>(
    rows: impl Fn(usize, usize) -> &'s [u8] + Sync + 's,
    row_bytes: usize,
    q: &'s [A],
    per: usize,
    (one, pairs): (fn(&[u8], usize, &[A], &mut [f32]), fn(&[u8], usize, [&[A]; 2], &mut [f32])),
) -> RowsDot<'s> {
    let token = move |t: usize| &q[t * per..(t + 1) * per];
    Box::new(move |r, t, tokens, out| {
        let n = out.len() / tokens;
        if tokens == 2 {
            pairs(rows(r, n), row_bytes, [token(t), token(t + 1)], out)
        } else {
            one(rows(r, n), row_bytes, token(t), out)
        }
    })
}

/// Tokens from which a product unpacks its rows once into tiles ([`super::tile`]); below, the
/// row kernels' unpacking per pair of tokens costs less.
const TILE_MIN_TOKENS: usize = 4;

/// The tile a product goes through, and its kernel.
#[derive(Clone, Copy)]
enum TileKind {
    K(TileKernel, Combine),
    Q32(Tile32Kernel, Combine32),
    Float(FloatUnpack, FloatTileKernel),
    /// Weights repacked at load ([`super::interleave`], [`super::interleave_k`]), for every
    /// token count.
    Interleaved(Repacked),
}

impl TileKind {
    /// Rows one tile holds.
    fn rows(self) -> usize {
        match self {
            TileKind::Float(..) => FLOAT_ROWS,
            TileKind::Interleaved(_) => interleave::GROUP,
            _ => ROWS,
        }
    }
}

/// The tile a product of `ty` weights with `tokens` tokens goes through; `None`: the row
/// kernels.
fn tile_kind(kernels: &Kernels, ty: GgmlType, tokens: usize) -> Option<TileKind> {
    if tokens < TILE_MIN_TOKENS {
        return None;
    }
    match (combine(ty), combine32(ty), activation_kind(ty)) {
        (Some(combine), _, _) => kernels.k_tile.map(|kernel| TileKind::K(kernel, combine)),
        (_, Some(combine), _) => kernels.tile32.map(|kernel| TileKind::Q32(kernel, combine)),
        (_, _, Some(ActivationKind::F32)) => kernels.float_tile.map(|(unpack, kernel)| TileKind::Float(unpack, kernel)),
        _ => None,
    }
}

/// `dot(r, t, tokens, out)` of [`PackedMatrix::rows_dot`].
type RowsDot<'s> = Box<dyn Fn(usize, usize, usize, &mut [f32]) + Sync + 's>;

/// How the tasks of one product compute their rows.
enum Product<'s> {
    /// Rows 1 to 4 and tokens 1 or 2 at a time (decode, short prefills, other types).
    Rows(RowsDot<'s>),
    /// Rows unpacked 8 (floats: 16) at a time, then multiplied with the tokens 4 at a time: the task.
    Tiled(Box<dyn Fn(SharedPtr<f32>, usize, usize) + Sync + 's>),
}

thread_local! {
    /// Each thread's unpacked rows, kept between products (they are a few tens of KiB).
    static TILE: RefCell<Vec<KBlock8>> = const { RefCell::new(Vec::new()) };
    static TILE32: RefCell<Vec<QBlock8>> = const { RefCell::new(Vec::new()) };
    static FLOAT_TILE: RefCell<Vec<FColumn16>> = const { RefCell::new(Vec::new()) };
}

/// Several products of the same activations (q, k and v; gate and up) in one parallel step of
/// the team: one hand-off to the threads instead of one per matrix.
pub fn multiply_all(products: &mut [(&PackedMatrix, &mut [f32])], x: &Activations, team: &Team) {
    let tokens = x.rows;
    let kernels = Kernels::detect();
    let mut tasks = Vec::new();
    let mut plans = Vec::with_capacity(products.len());
    for (i, (m, out)) in products.iter_mut().enumerate() {
        let m: &PackedMatrix = m;
        assert_eq!(out.len(), tokens * m.rows);
        let mut tile = tile_rows(m.rows, tokens, m.cols, team.threads());
        assert_eq!(x.cols, m.cols, "activations have {} columns, the weights {}", x.cols, m.cols);
        let kind = match m.interleaved {
            // The negative control of batch invariance: a batch's steps in another order.
            Some(Repacked::Blocks32(_)) if x.reordered => Some(TileKind::Interleaved(Repacked::Blocks32(|ty, records, a, out| interleave::scalar(ty, records, a, out, true)))),
            Some(Repacked::Super256(_)) if x.reordered => Some(TileKind::Interleaved(Repacked::Super256(|ty, records, a, out| interleave_k::scalar(ty, records, a, out, true)))),
            Some(repacked) => Some(TileKind::Interleaved(repacked)),
            None if x.separate_steps => None,
            None => tile_kind(kernels, m.ty, tokens),
        };
        let product = match kind {
            None => Product::Rows(m.rows_dot(x, team)),
            Some(TileKind::Interleaved(Repacked::Blocks32(kernel))) => {
                let (a, rec) = (x.q8x32(team), interleave::record_bytes(m.ty).expect("a repacked type"));
                Product::Tiled(Box::new(move |out, first, last| interleaved_task(m, a, 32, rec, |r, a, s| kernel(m.ty, r, a, s), out, tokens, first, last)))
            }
            Some(TileKind::Interleaved(Repacked::Super256(kernel))) => {
                let (a, rec) = (x.q8x256(team), interleave_k::record_bytes(m.ty).expect("a repacked type"));
                Product::Tiled(Box::new(move |out, first, last| interleaved_task(m, a, 256, rec, |r, a, s| kernel(m.ty, r, a, s), out, tokens, first, last)))
            }
            Some(TileKind::Float(unpack, kernel)) => {
                let a = x.values;
                Product::Tiled(Box::new(move |out, first, last| {
                    tiled_task::<_, _, FLOAT_ROWS>(&FLOAT_TILE, m, a, 1, |w, n, tile| unpack(m.ty, w, m.row_bytes, n, tile), kernel, out, tokens, first, last)
                }))
            }
            Some(TileKind::K(kernel, combine)) => {
                let a = x.q8x256(team);
                Product::Tiled(Box::new(move |out, first, last| {
                    tiled_task::<_, _, ROWS>(&TILE, m, a, 256, |w, n, tile| unpack(m.ty, w, m.row_bytes, n, tile), |tile, a, sums| kernel(tile, a, combine, sums), out, tokens, first, last)
                }))
            }
            Some(TileKind::Q32(kernel, combine)) => {
                let a = x.q8x32(team);
                Product::Tiled(Box::new(move |out, first, last| {
                    tiled_task::<_, _, ROWS>(&TILE32, m, a, 32, |w, n, tile| unpack32(m.ty, w, m.row_bytes, n, tile), |tile, a, sums| kernel(tile, a, combine, sums), out, tokens, first, last)
                }))
            }
        };
        if let Some(kind) = kind {
            tile = tile.next_multiple_of(kind.rows());
        }
        plans.push((product, SharedPtr(out.as_mut_ptr()), m.rows));
        tasks.extend((0..m.rows.div_ceil(tile)).map(|k| (i, k * tile, ((k + 1) * tile).min(m.rows))));
    }
    // Rows are split into tiles over the threads; within a tile every token reads the tile's
    // rows while they are in cache.
    team.for_each(tasks.len(), |task| {
        let (i, first, last) = tasks[task];
        let (product, out, rows) = &plans[i];
        match product {
            Product::Rows(dot) => rows_task(dot, *out, *rows, tokens, first, last),
            Product::Tiled(task) => task(*out, first, last),
        }
    });
}

/// Rows `first..last` of a product for every token, through the row kernels.
fn rows_task(dot: &RowsDot, out: SharedPtr<f32>, rows: usize, tokens: usize, first: usize, last: usize) {
    // Tokens two at a time (a kernel unpacks each weight block once for both), the last
    // alone if their count is odd.
    let mut t = 0;
    while t < tokens {
        let pair = if t + 1 < tokens { 2 } else { 1 };
        let mut r = first;
        while r < last {
            let n = (last - r).min(4);
            let mut sums = [0f32; 8];
            dot(r, t, pair, &mut sums[..pair * n]);
            for k in 0..pair {
                // SAFETY: rows r..r + n of token t + k belong to this task alone, inside the
                // product's `out`.
                unsafe { out.slice((t + k) * rows + r, n) }.copy_from_slice(&sums[k * n..(k + 1) * n]);
            }
            r += n;
        }
        t += pair;
    }
}

/// Rows `first..last` of a product for every token: `R` rows unpacked at a time (`unpack(rows,
/// count, tile)`, into this thread's `scratch`), then multiplied with the tokens 4 at a time while
/// they sit in the L1/L2 cache (`kernel(tile, tokens' activations, sums)`).
#[allow(clippy::too_many_arguments)]
fn tiled_task<B: Default + Clone + 'static, A, const R: usize>(
    scratch: &'static std::thread::LocalKey<RefCell<Vec<B>>>,
    m: &PackedMatrix,
    a: &[A],
    block: usize,
    unpack: impl Fn(&[u8], usize, &mut [B]),
    kernel: impl Fn(&[B], &[&[A]], &mut [[f32; R]; TOKENS]),
    out: SharedPtr<f32>,
    tokens: usize,
    first: usize,
    last: usize,
) {
    let per = m.cols / block;
    scratch.with(|tile| {
        let mut tile = tile.borrow_mut();
        if tile.len() < per {
            tile.resize(per, B::default());
        }
        let tile = &mut tile[..per];
        for r in (first..last).step_by(R) {
            let n = (last - r).min(R);
            unpack(&m.data[r * m.row_bytes..(r + n) * m.row_bytes], n, tile);
            for t in (0..tokens).step_by(TOKENS) {
                let k = (tokens - t).min(TOKENS);
                let token: [&[A]; TOKENS] = std::array::from_fn(|j| &a[(t + j).min(tokens - 1) * per..][..per]);
                let mut sums = [[0f32; R]; TOKENS];
                kernel(tile, &token[..k], &mut sums);
                for (j, sums) in sums[..k].iter().enumerate() {
                    // SAFETY: rows r..r + n of token t + j belong to this task alone, inside the
                    // product's `out`.
                    unsafe { out.slice((t + j) * m.rows + r, n) }.copy_from_slice(&sums[..n]);
                }
            }
        }
    });
}

/// Rows `first..last` (whole groups of 16) of a product of repacked weights for every token:
/// each group's records (`rec` bytes per `block` columns), in cache, serve the tokens 4 at a
/// time.
#[allow(clippy::too_many_arguments)]
fn interleaved_task<A>(
    m: &PackedMatrix,
    a: &[A],
    block: usize,
    rec: usize,
    kernel: impl Fn(&[u8], &[&[A]], &mut [[f32; interleave::GROUP]; TOKENS]),
    out: SharedPtr<f32>,
    tokens: usize,
    first: usize,
    last: usize,
) {
    use interleave::GROUP;
    let per = m.cols / block;
    let group_bytes = per * rec;
    for r in (first..last).step_by(GROUP) {
        let n = (last - r).min(GROUP);
        let records = &m.data[r / GROUP * group_bytes..][..group_bytes];
        for t in (0..tokens).step_by(TOKENS) {
            let k = (tokens - t).min(TOKENS);
            let token: [&[A]; TOKENS] = std::array::from_fn(|j| &a[(t + j).min(tokens - 1) * per..][..per]);
            let mut sums = [[0f32; GROUP]; TOKENS];
            kernel(records, &token[..k], &mut sums);
            for (j, sums) in sums[..k].iter().enumerate() {
                // SAFETY: rows r..r + n of token t + j belong to this task alone, inside the
                // product's `out`.
                unsafe { out.slice((t + j) * m.rows + r, n) }.copy_from_slice(&sums[..n]);
            }
        }
    }
}

/// Rows per task: enough work per task to pay for handing it out, and enough tasks to keep
/// every thread busy to the end. A decode step (up to [`TOKENS`] tokens: each weight is read
/// once) gives each thread one run of rows, the longest stream its prefetches can follow
/// (SmolLM2 Q4_1, 4 sequences on 2 threads: ~10% faster than four runs per thread).
fn tile_rows(rows: usize, tokens: usize, cols: usize, threads: usize) -> usize {
    const MIN_WORK: usize = 64 * 1024;
    let by_work = MIN_WORK.div_ceil(cols * tokens).max(1);
    if tokens <= TOKENS {
        return by_work.max(rows.div_ceil(threads)).min(rows.max(1));
    }
    let by_balance = rows.div_ceil(threads * 4).max(1);
    // Prefill tiles stay small enough for the tile's rows to sit in the L1/L2 cache.
    let by_cache = (64 * 1024 / cols.max(1)).max(4);
    by_work.max(by_balance.min(by_cache)).min(rows.max(1))
}

/// A buffer that the tasks of one parallel step write disjoint parts of.
#[derive(Clone, Copy)]
pub(crate) struct SharedPtr<T>(pub *mut T);
unsafe impl<T: Send> Send for SharedPtr<T> {}
unsafe impl<T: Send> Sync for SharedPtr<T> {}
impl<T> SharedPtr<T> {
    /// # Safety
    /// `at..at + len` lies inside the buffer, and no other task touches it during the step.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, at: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

/// `rows` activation vectors of `cols` values, quantized on first use to the form a weight type
/// multiplies with (once per form, however many matrices read them).
pub struct Activations<'a> {
    values: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    /// Rows of several sequences' decode steps: they go through the row kernels, which give each
    /// row exactly what it gets alone (one or two tokens per call, the same sums either way), so
    /// a sequence's tokens do not depend on which others share its steps. The tiles add in
    /// another order than the row kernels.
    separate_steps: bool,
    /// The test defect of batch invariance for repacked weights: a batch's steps go through the
    /// scalar kernel with its float steps in another order.
    reordered: bool,
    q32: OnceLock<Vec<Q8x32>>,
    q256: OnceLock<Vec<Q8x256>>,
}

impl<'a> Activations<'a> {
    pub fn new(values: &'a [f32], rows: usize, cols: usize) -> Self {
        assert_eq!(values.len(), rows * cols);
        Self { values, rows, cols, separate_steps: false, reordered: false, q32: OnceLock::new(), q256: OnceLock::new() }
    }

    /// One row per sequence, each its decode step (see `separate_steps`).
    pub fn decode_steps(values: &'a [f32], rows: usize, cols: usize) -> Self {
        let defect = crate::test_defect("batch-tiles");
        Self { separate_steps: !defect, reordered: defect && rows > 1, ..Self::new(values, rows, cols) }
    }

    fn row_f32(&self, t: usize) -> &[f32] {
        &self.values[t * self.cols..(t + 1) * self.cols]
    }

    fn q8x32(&self, team: &Team) -> &[Q8x32] {
        self.q32.get_or_init(|| self.quantized(team, 32, quantize_q8x32))
    }

    fn q8x256(&self, team: &Team) -> &[Q8x256] {
        self.q256.get_or_init(|| self.quantized(team, 256, quantize_q8x256))
    }

    /// Every row quantized to blocks of `block` values, rows spread over the team.
    fn quantized<B: Default + Clone + Send>(&self, team: &Team, block: usize, quantize: fn(&[f32], &mut [B])) -> Vec<B> {
        let per = self.cols / block;
        let mut q = vec![B::default(); self.rows * per];
        let out = SharedPtr(q.as_mut_ptr());
        team.for_each(self.rows, |t| {
            // SAFETY: row t's blocks belong to this task alone.
            let row = unsafe { out.slice(t * per, per) };
            quantize(self.row_f32(t), row);
        });
        q
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
            m.multiply(&Activations::new(&x, tokens, cols), &mut out, &Team::solo());
            for t in 0..tokens {
                let xt = &x[t * cols..(t + 1) * cols];
                let reference = if m.ty == GgmlType::F32 {
                    (0..rows).map(|r| { let mut o = [0f32]; (Kernels::SCALAR.f32_rows)(&m.row(r), m.row_bytes, xt, &mut o); o[0] }).collect::<Vec<_>>()
                } else {
                    let mut q = vec![crate::cpu::dot::Q8x32::default(); cols / 32];
                    crate::cpu::dot::quantize_q8x32(xt, &mut q);
                    (0..rows).map(|r| { let mut o = [0f32]; (Kernels::SCALAR.q8_0)(&m.row(r), m.row_bytes, &q, &mut o); o[0] }).collect::<Vec<_>>()
                };
                for (r, want) in reference.iter().enumerate() {
                    let got = out[t * rows + r];
                    assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{} token {t} row {r}: {got} vs {want}", m.ty);
                }
            }
        }
    }

    /// A prefill's products (tokens in fours and a remainder, rows in eights and a remainder,
    /// through the unpacked tiles where this processor has them, on the pool's threads) equal
    /// the scalar row reference bit for bit, for every packed type.
    #[test]
    fn prefill_products_equal_the_reference_exactly() {
        use crate::cpu::conformance::{activations, blocks, Blocks, TYPES};
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let floats = [GgmlType::F32, GgmlType::F16, GgmlType::BF16].map(|ty| (ty, &[][..]));
        // 21 rows: tiles of 8 and a remainder; 32: two groups of 16, repacked where this
        // processor repacks the type.
        for (rows, &(ty, scale_at)) in [21, 32].into_iter().flat_map(|rows| TYPES.iter().chain(&floats).map(move |t| (rows, t))) {
            let cols = 2 * 256;
            let w = match ty {
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                    use rand::Rng;
                    let values: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                    match ty {
                        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
                        GgmlType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
                        _ => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
                    }
                }
                _ => blocks(ty, scale_at, rows * cols / ty.block_elements(), Blocks::Random, &mut rng),
            };
            let m = PackedMatrix::new(ty, rows, cols, Bytes::Owned(w)).unwrap();
            for tokens in [1, 2, 7] {
                let x: Vec<f32> = (0..tokens).flat_map(|_| activations(cols, &mut rng)).collect();
                let mut out = vec![0f32; tokens * rows];
                Team::run(|team| m.multiply(&Activations::new(&x, tokens, cols), &mut out, team));
                for t in 0..tokens {
                    for r in 0..rows {
                        let mut want = [0f32];
                        crate::cpu::conformance::rows_with(&Kernels::SCALAR, ty, &m.row(r), m.row_bytes, &x[t * cols..(t + 1) * cols], &mut want);
                        let got = out[t * rows + r];
                        if m.is_interleaved() || matches!(tile_kind(Kernels::detect(), ty, tokens), Some(TileKind::K(..) | TileKind::Q32(..))) {
                            assert!(got == want[0], "{ty} token {t} row {r}: {got} vs {}", want[0]);
                        } else {
                            // The row kernels and the float tiles add in another order than the
                            // reference.
                            assert!((got - want[0]).abs() <= 1e-4 * want[0].abs().max(cols as f32 / 10.0), "{ty} token {t} row {r}: {got} vs {}", want[0]);
                        }
                    }
                }
            }
        }
    }
}
