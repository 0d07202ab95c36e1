//! Causal attention over the CPU KV cache, and the vector `exp` it and SiLU share.
//!
//! One work item is a token, a KV head and a piece of up to [`PIECE`] positions: the query heads
//! sharing that KV head (grouped-query attention: 3 in SmolLM2) score the piece's keys and sum
//! its values together, so each key and value is read once per group instead of once per query
//! head; the pieces' results are then combined, so one token's long context keeps every thread
//! busy. Keys are stored a block of [`KEY_BLOCK`] positions at a time with the position
//! innermost (`[head_dim][KEY_BLOCK]`): one vector multiply-add scores 16 positions against one
//! query value, and no sum ever crosses vector lanes. Values stay one row per position; a head's output is summed in registers,
//! 64 values at a time, over every row.
//!
//! The cache is paged: a sequence holds a table of blocks ([`KvBlock`]), each [`KEY_BLOCK`]
//! positions of every layer, allocated as its positions are written and shared (read-only) with
//! other sequences whose prompts begin the same way (`super::prefix`). The kernels read a KV
//! head's part of each block in turn, with the sums chained across blocks exactly as over one
//! contiguous run.
//!
//! Every sum is a fixed set of fused multiply-add chains added in a fixed order (a score: four
//! chains over the dimensions; an output: even and odd positions), the same whatever vector
//! width computes it, and the pieces are combined in order: a token's result depends only on
//! its query, the cache and how many positions it sees, so a sequence computes the same in a
//! batch as alone, and in a prefill as token by token.

use std::sync::Arc;

use half::f16;

use super::dot::Kernels;
use super::matrix::SharedPtr;
use super::team::Team;

/// Positions per block of the key cache.
pub const KEY_BLOCK: usize = 16;

/// Values of a KV block, f32 or f16.
#[derive(Clone)]
pub(super) enum KvBuffer {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

/// [`KEY_BLOCK`] positions of every layer's keys and values: one page of a sequence's cache.
/// Layer `l`'s KV head `g` has two parts of `KEY_BLOCK · head_dim` values, at
/// [`KvLayout::keys_at`]: its keys (`[head_dim][KEY_BLOCK]`, position innermost), then its
/// values (`[KEY_BLOCK][head_dim]`, a row per position).
#[derive(Clone)]
pub struct KvBlock {
    pub(super) values: KvBuffer,
    /// Counts the block in its model's resident KV bytes while it lives.
    pub(super) _live: Tally,
}

/// Bytes of live blocks, shared by every block a model allocated: each block adds its bytes
/// while it lives (a copy adds its own), however many sequences and caches hold it.
#[derive(Debug, Default)]
pub struct Tally {
    bytes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    own: usize,
}

impl Tally {
    /// Counts `own` bytes in `bytes` until dropped.
    pub(super) fn count(bytes: &std::sync::Arc<std::sync::atomic::AtomicUsize>, own: usize) -> Self {
        bytes.fetch_add(own, std::sync::atomic::Ordering::Relaxed);
        Self { bytes: bytes.clone(), own }
    }
}

impl Clone for Tally {
    fn clone(&self) -> Self {
        Self::count(&self.bytes, self.own)
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        self.bytes.fetch_sub(self.own, std::sync::atomic::Ordering::Relaxed);
    }
}

impl KvBlock {
    /// Bytes the block holds.
    pub fn bytes(&self) -> usize {
        match &self.values {
            KvBuffer::F32(b) => b.len() * 4,
            KvBuffer::F16(b) => b.len() * 2,
        }
    }
}

/// Where a KV head's keys and values lie in a block.
#[derive(Clone, Copy)]
pub(super) struct KvLayout {
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Values of one part of a block: a KV head's keys, or its values.
    pub fn part_len(self) -> usize {
        KEY_BLOCK * self.head_dim
    }

    /// Values of a block holding `layers` layers.
    pub fn block_len(self, layers: usize) -> usize {
        layers * self.kv_heads * 2 * self.part_len()
    }

    /// Where layer `layer`'s KV head `g` keys start in a block; its values follow them.
    pub fn keys_at(self, layer: usize, g: usize) -> usize {
        (layer * self.kv_heads + g) * 2 * self.part_len()
    }

    /// Writes the key and value of KV head `g` of layer `layer` at position `p` of the block
    /// (`p < KEY_BLOCK`).
    pub fn write(self, block: &mut KvBuffer, layer: usize, g: usize, p: usize, k: &[f32], v: &[f32]) {
        // A key's dimensions lie KEY_BLOCK values apart.
        let first = self.keys_at(layer, g) + p;
        let places = (first..first + self.head_dim * KEY_BLOCK).step_by(KEY_BLOCK);
        let at = self.keys_at(layer, g) + self.part_len() + p * self.head_dim;
        match block {
            KvBuffer::F32(b) => {
                places.zip(k).for_each(|(at, k)| b[at] = *k);
                b[at..at + self.head_dim].copy_from_slice(v);
            }
            KvBuffer::F16(b) => {
                places.zip(k).for_each(|(at, k)| b[at] = f16::from_f32(*k));
                b[at..at + self.head_dim].iter_mut().zip(v).for_each(|(o, v)| *o = f16::from_f32(*v));
            }
        }
    }
}

/// One token's attention: its sequence's blocks, the layer, and how many positions it sees
/// (itself included).
pub(super) struct Query<'a> {
    pub blocks: &'a [Arc<KvBlock>],
    pub layout: KvLayout,
    pub layer: usize,
    pub seen: usize,
}

/// Positions one piece of a query's attention covers at most. A long context is split into
/// pieces, each scored and summed on its own (on any of the team's threads), then combined in
/// order: a token's attention spreads over every thread even when its KV heads are fewer than
/// the threads (SmolLM2 has 3). The split depends only on how many positions a query sees, so a
/// sequence computes the same bits alone, in a batch, and in a prefill.
const PIECE: usize = 16 * KEY_BLOCK;

/// Items whose partial results one pass holds at most: a long prefill's would otherwise take
/// several times the memory of its output (1536 tokens of SmolLM2: ~13 MB).
const ITEMS_PER_PASS: usize = 512;

/// Causal attention of every token's query heads `q` (`[tokens, nh, d]`) over what its
/// [`Query`] sees, into `out` (`[tokens, nh, d]`), in passes of whole tokens.
pub(super) fn attend(queries: &[Query], nh: usize, kvh: usize, d: usize, q: &[f32], out: &mut [f32], team: &Team) {
    let mut first = 0;
    while first < queries.len() {
        let (mut last, mut items) = (first, 0);
        while last < queries.len() && (last == first || items + kvh * queries[last].seen.div_ceil(PIECE) <= ITEMS_PER_PASS) {
            items += kvh * queries[last].seen.div_ceil(PIECE);
            last += 1;
        }
        let rows = first * nh * d..last * nh * d;
        attend_pass(&queries[first..last], nh, kvh, d, &q[rows.clone()], &mut out[rows], team);
        first = last;
    }
}

/// One pass of [`attend`].
fn attend_pass(queries: &[Query], nh: usize, kvh: usize, d: usize, q: &[f32], out: &mut [f32], team: &Team) {
    let rep = nh / kvh;
    // One item per token, KV head and piece, in that order; each gives its `rep` heads' partial
    // results (`[rep][2 + d]`, see `attend_piece`).
    let (stride, scale, simd) = (rep * (2 + d), 1.0 / (d as f32).sqrt(), vectors());
    let items: Vec<(usize, usize, usize)> = queries
        .iter()
        .enumerate()
        .flat_map(|(t, query)| (0..kvh).flat_map(move |g| (0..query.seen.div_ceil(PIECE)).map(move |piece| (t, g, piece))))
        .collect();
    let mut parts = vec![0f32; items.len() * stride];
    let per_item = |i: usize, part: &mut [f32]| {
        let (t, g, piece) = items[i];
        let heads = (t * nh + g * rep) * d..(t * nh + (g + 1) * rep) * d;
        attend_piece(&queries[t], g, piece, (rep, d, scale), &q[heads], part);
    };
    // Each token and KV head's pieces, combined into its heads' outputs.
    let mut groups = Vec::with_capacity(queries.len() * kvh);
    let mut first = 0;
    for query in queries {
        let pieces = query.seen.div_ceil(PIECE);
        for _ in 0..kvh {
            groups.push(first..first + pieces);
            first += pieces;
        }
    }
    let combine_group = |parts: &[f32], group: usize, out: &mut [f32]| {
        simd.combine(&parts[groups[group].start * stride..groups[group].end * stride], d, scale, out)
    };
    // A short context is too little work to hand out; so is combining a few pieces (a decode
    // step's), which costs less than a hand-off to the threads.
    const HAND_OUT: usize = 64 * 1024;
    let work: usize = queries.iter().map(|query| nh * query.seen * d).sum();
    if work >= HAND_OUT {
        let shared = SharedPtr(parts.as_mut_ptr());
        // SAFETY: item i writes its own `stride` values.
        team.for_each(items.len(), |i| per_item(i, unsafe { shared.slice(i * stride, stride) }));
    } else {
        parts.chunks_mut(stride).enumerate().for_each(|(i, part)| per_item(i, part));
    }
    if items.len() * rep * d >= HAND_OUT {
        let shared = SharedPtr(out.as_mut_ptr());
        // SAFETY: group i writes its own `rep * d` values.
        team.for_each(groups.len(), |i| combine_group(&parts, i, unsafe { shared.slice(i * rep * d, rep * d) }));
    } else {
        out.chunks_mut(rep * d).enumerate().for_each(|(i, out)| combine_group(&parts, i, out));
    }
}

/// Piece `piece` of the attention of the `rep` query heads of KV head `g` (`q`: `[rep, d]`):
/// for each head, into `part` (`[rep][2 + d]`), the largest score `m` of the piece's
/// positions, the sum of their `e^((score - m) · scale)`, and the values summed with those
/// weights.
fn attend_piece(query: &Query, g: usize, piece: usize, (rep, d, scale): (usize, usize, f32), q: &[f32], part: &mut [f32]) {
    let (layout, simd) = (query.layout, vectors());
    let first = piece * PIECE;
    let seen = (query.seen - first).min(PIECE);
    let blocks = &query.blocks[first / KEY_BLOCK..(first + seen).div_ceil(KEY_BLOCK)];
    let padded = blocks.len() * KEY_BLOCK;
    let mut scores = vec![0f32; rep * padded];
    let (keys, len) = (layout.keys_at(query.layer, g), layout.part_len());
    simd.scores(blocks, keys..keys + len, q, d, &mut scores, padded);
    for (weights, part) in scores.chunks_exact_mut(padded).zip(part.chunks_exact_mut(2 + d)) {
        let (max, sum) = simd.exp_below_max(&mut weights[..seen], scale);
        part[0] = max;
        part[1] = sum;
        simd.weighted_sum(blocks, keys + len..keys + 2 * len, d, &weights[..seen], &mut part[2..]);
    }
}

/// The vector width the loops below are compiled for: the one the chosen kernel set
/// ([`Kernels::detect`]) was built for, whose features it implies. Each form takes the same
/// steps per value, so all of them give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Vectors {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Plain,
}

pub(super) fn vectors() -> Vectors {
    match Kernels::detect().name {
        #[cfg(target_arch = "x86_64")]
        "avx512-vnni" => Vectors::Avx512,
        #[cfg(target_arch = "x86_64")]
        "avx2" => Vectors::Avx2,
        _ => Vectors::Plain,
    }
}

/// Values a kernel reads 16 at a time as f32: an f32 cache as it is, an f16 cache converted in
/// registers by the width's own instruction (`W`: 2 AVX-512, 1 F16C on 256 bits, 0 none).
trait Lanes: Copy {
    fn load16(self, at: usize) -> [f32; 16];
    /// [`Self::load16`] without its bounds check.
    ///
    /// # Safety
    /// `at + 16 ≤ self.len()`.
    unsafe fn load16_unchecked(self, at: usize) -> [f32; 16];
    fn len(self) -> usize;
    fn get(self, at: usize) -> f32;
    /// Asks for the line holding value `at` (past the end: nothing).
    fn prefetch(self, at: usize);
}

#[derive(Clone, Copy)]
struct F32Lanes<'a>(&'a [f32]);

#[derive(Clone, Copy)]
struct F16Lanes<'a, const W: u8>(&'a [f16]);

#[inline(always)]
fn prefetch_line<T>(values: &[T], at: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, wherever it points.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(values.as_ptr().wrapping_add(at) as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (values, at);
}

impl Lanes for F32Lanes<'_> {
    #[inline(always)]
    fn load16(self, at: usize) -> [f32; 16] {
        self.0[at..at + 16].try_into().expect("16 values")
    }
    #[inline(always)]
    unsafe fn load16_unchecked(self, at: usize) -> [f32; 16] {
        debug_assert!(at + 16 <= self.0.len());
        std::ptr::read_unaligned(self.0.as_ptr().add(at) as *const [f32; 16])
    }
    #[inline(always)]
    fn len(self) -> usize {
        self.0.len()
    }
    #[inline(always)]
    fn get(self, at: usize) -> f32 {
        self.0[at]
    }
    #[inline(always)]
    fn prefetch(self, at: usize) {
        prefetch_line(self.0, at)
    }
}

impl<const W: u8> Lanes for F16Lanes<'_, W> {
    #[inline(always)]
    fn load16(self, at: usize) -> [f32; 16] {
        assert!(at + 16 <= self.0.len(), "16 values");
        // SAFETY: checked just above.
        unsafe { self.load16_unchecked(at) }
    }
    #[inline(always)]
    fn len(self) -> usize {
        self.0.len()
    }
    #[inline(always)]
    unsafe fn load16_unchecked(self, at: usize) -> [f32; 16] {
        debug_assert!(at + 16 <= self.0.len());
        let v = std::slice::from_raw_parts(self.0.as_ptr().add(at), 16);
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            // SAFETY: `v` holds 16 values; W names features the processor has (see `vectors`),
            // and this is only inlined into functions compiled with them.
            if W == 2 {
                return unsafe { std::mem::transmute::<__m512, [f32; 16]>(_mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr() as *const __m256i))) };
            }
            if W == 1 {
                return unsafe {
                    let p = v.as_ptr() as *const __m128i;
                    std::mem::transmute::<[__m256; 2], [f32; 16]>([_mm256_cvtph_ps(_mm_loadu_si128(p)), _mm256_cvtph_ps(_mm_loadu_si128(p.add(1)))])
                };
            }
        }
        std::array::from_fn(|l| v[l].to_f32())
    }
    #[inline(always)]
    fn get(self, at: usize) -> f32 {
        self.0[at].to_f32()
    }
    #[inline(always)]
    fn prefetch(self, at: usize) {
        prefetch_line(self.0, at)
    }
}

/// Calls `$body` with `$range` of each block as [`Lanes`] of width `$w`: the pages of one KV
/// head's keys or values. A cache holds one precision.
macro_rules! with_pages {
    ($blocks:expr, $range:expr, $w:literal, |$pages:ident| $body:expr) => {
        match &$blocks[0].values {
            KvBuffer::F32(_) => {
                let $pages: Vec<F32Lanes> = $blocks
                    .iter()
                    .map(|b| match &b.values {
                        KvBuffer::F32(b) => F32Lanes(&b[$range.clone()]),
                        KvBuffer::F16(_) => unreachable!("one precision per cache"),
                    })
                    .collect();
                $body
            }
            KvBuffer::F16(_) => {
                let $pages: Vec<F16Lanes<'_, $w>> = $blocks
                    .iter()
                    .map(|b| match &b.values {
                        KvBuffer::F16(b) => F16Lanes::<'_, $w>(&b[$range.clone()]),
                        KvBuffer::F32(_) => unreachable!("one precision per cache"),
                    })
                    .collect();
                $body
            }
        }
    };
}

impl Vectors {
    /// `scores[h · stride + j] = q_h · key_j` for the heads of `q` (`[heads, d]`) and every
    /// position of the blocks, whose keys lie at `range` of each (`[d][KEY_BLOCK]`).
    fn scores(self, blocks: &[Arc<KvBlock>], range: std::ops::Range<usize>, q: &[f32], d: usize, scores: &mut [f32], stride: usize) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: chosen only where the processor has these features.
            Vectors::Avx512 => with_pages!(blocks, range, 2, |k| unsafe { wide::scores(&k, q, d, scores, stride) }),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Vectors::Avx2 => with_pages!(blocks, range, 1, |k| unsafe { narrow::scores(&k, q, d, scores, stride) }),
            Vectors::Plain => with_pages!(blocks, range, 0, |k| scores_body(&k, q, d, scores, stride)),
        }
    }

    /// `out = Σ_j weights[j] · row j` over the first `weights.len()` positions of the blocks,
    /// whose value rows lie at `range` of each (`[KEY_BLOCK][d]`).
    fn weighted_sum(self, blocks: &[Arc<KvBlock>], range: std::ops::Range<usize>, d: usize, weights: &[f32], out: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: chosen only where the processor has these features.
            Vectors::Avx512 => with_pages!(blocks, range, 2, |v| unsafe { wide::weighted_sum(&v, d, weights, out) }),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Vectors::Avx2 => with_pages!(blocks, range, 1, |v| unsafe { narrow::weighted_sum(&v, d, weights, out) }),
            Vectors::Plain => with_pages!(blocks, range, 0, |v| weighted_sum_body(&v, d, weights, out)),
        }
    }

    /// `x = e^((x - m) · scale)` with `m` the largest `x`; gives `m` and the sum of the new `x`.
    fn exp_below_max(self, x: &mut [f32], scale: f32) -> (f32, f32) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: chosen only where the processor has these features.
            Vectors::Avx512 => unsafe { wide::exp_below_max(x, scale) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Vectors::Avx2 => unsafe { narrow::exp_below_max(x, scale) },
            Vectors::Plain => exp_below_max_body(x, scale),
        }
    }

    /// Each head's output (`out`: `[rep, d]`) from the parts of its pieces (`parts`: per
    /// piece, per head, `[max, sum, d weighted sums]`).
    fn combine(self, parts: &[f32], d: usize, scale: f32, out: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: chosen only where the processor has these features.
            Vectors::Avx512 => unsafe { wide::combine(parts, d, scale, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Vectors::Avx2 => unsafe { narrow::combine(parts, d, scale, out) },
            Vectors::Plain => combine_body(parts, d, scale, out),
        }
    }

    /// `x = eˣ` for every value, within 2 ulp of the exact result.
    pub fn exp(self, x: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: chosen only where the processor has these features.
            Vectors::Avx512 => unsafe { wide::exp(x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Vectors::Avx2 => unsafe { narrow::exp(x) },
            Vectors::Plain => exp_body(x),
        }
    }
}

/// The loops compiled with a width's features: one module per width, the same functions.
macro_rules! compiled_for {
    ($module:ident, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        mod $module {
            use super::Lanes;
            #[target_feature(enable = $features)]
            pub(super) unsafe fn scores<L: Lanes>(pages: &[L], q: &[f32], d: usize, scores: &mut [f32], stride: usize) {
                super::scores_body(pages, q, d, scores, stride)
            }
            #[target_feature(enable = $features)]
            pub(super) unsafe fn weighted_sum<L: Lanes>(pages: &[L], d: usize, weights: &[f32], out: &mut [f32]) {
                super::weighted_sum_body(pages, d, weights, out)
            }
            #[target_feature(enable = $features)]
            pub(super) unsafe fn combine(parts: &[f32], d: usize, scale: f32, out: &mut [f32]) {
                super::combine_body(parts, d, scale, out)
            }
            #[target_feature(enable = $features)]
            pub(super) unsafe fn exp(x: &mut [f32]) {
                super::exp_body(x)
            }
            #[target_feature(enable = $features)]
            pub(super) unsafe fn exp_below_max(x: &mut [f32], scale: f32) -> (f32, f32) {
                super::exp_below_max_body(x, scale)
            }
        }
    };
}
compiled_for!(wide, "avx512f,avx2,fma,f16c");
compiled_for!(narrow, "avx2,fma,f16c");

// The loops ask for the lines of pages ahead of the one they read (the key loops two on, the
// value loops the next): each block is an allocation of its own, where the hardware's
// prefetcher, which stops at every 4 KiB page, cannot follow.

#[inline(always)]
fn scores_body<L: Lanes>(pages: &[L], q: &[f32], d: usize, scores: &mut [f32], stride: usize) {
    let blocks = stride / KEY_BLOCK;
    debug_assert_eq!(blocks, pages.len());
    for (h, qh) in q.chunks_exact(d).enumerate() {
        let scores = &mut scores[h * stride..];
        // The first head brings the blocks in for the rest.
        let ahead = if h == 0 { pages } else { &[] };
        // Two blocks at a time: eight independent chains keep the multiply-adds overlapping.
        let mut b = 0;
        while b + 2 <= blocks {
            let next = [ahead.get(b + 2).copied(), ahead.get(b + 3).copied()];
            score_blocks::<2, L>([pages[b], pages[b + 1]], next, qh, &mut scores[b * KEY_BLOCK..(b + 2) * KEY_BLOCK]);
            b += 2;
        }
        if b < blocks {
            score_blocks::<1, L>([pages[b]], [None], qh, &mut scores[b * KEY_BLOCK..(b + 1) * KEY_BLOCK]);
        }
    }
}

/// Scores of `B` key blocks: per block, four chains (dimensions `c ≡ 0..3 mod 4`) added at the
/// end, the same steps whatever `B`. `next`: blocks whose lines to ask for meanwhile.
#[inline(always)]
fn score_blocks<const B: usize, L: Lanes>(keys: [L; B], next: [Option<L>; B], q: &[f32], scores: &mut [f32]) {
    let d = q.len();
    let mut acc = [[[0f32; KEY_BLOCK]; 4]; B];
    let whole = d / 4 * 4;
    for c in (0..whole).step_by(4) {
        for (b, acc) in acc.iter_mut().enumerate() {
            let at = c * KEY_BLOCK;
            if let Some(next) = next[b] {
                // Four rows of 16 f32 values are four lines (f16: two).
                for j in 0..4 {
                    next.prefetch(at + j * KEY_BLOCK);
                }
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let (qc, k) = (q[c + j], keys[b].load16(at + j * KEY_BLOCK));
                for l in 0..KEY_BLOCK {
                    acc[l] = qc.mul_add(k[l], acc[l]);
                }
            }
        }
    }
    for (b, acc) in acc.iter_mut().enumerate() {
        for c in whole..d {
            let k = keys[b].load16(c * KEY_BLOCK);
            for l in 0..KEY_BLOCK {
                acc[0][l] = q[c].mul_add(k[l], acc[0][l]);
            }
        }
        for l in 0..KEY_BLOCK {
            scores[b * KEY_BLOCK + l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
        }
    }
}

/// Columns of the output summed in registers at a time.
const SUM_WIDTH: usize = 64;

/// Even and odd rows in two chains per column (twice the multiply-adds in flight of one),
/// summed in registers `SUM_WIDTH` columns at a time, the chains added at the end. Row `j` is
/// row `j % KEY_BLOCK` of page `j / KEY_BLOCK`; a page's rows are read in turn, so the parity
/// of a row within its page is its parity overall (`KEY_BLOCK` is even).
#[inline(always)]
fn weighted_sum_body<L: Lanes>(pages: &[L], d: usize, weights: &[f32], out: &mut [f32]) {
    const { assert!(KEY_BLOCK % 2 == 0) };
    let whole = d / SUM_WIDTH * SUM_WIDTH;
    assert!(weights.len() <= pages.len() * KEY_BLOCK, "a weight per row");
    for page in pages {
        assert!(page.len() >= KEY_BLOCK * d, "a page holds KEY_BLOCK rows of {d} values");
    }
    for at in (0..whole).step_by(SUM_WIDTH) {
        let (mut even, mut odd) = ([0f32; SUM_WIDTH], [0f32; SUM_WIDTH]);
        for (b, (&page, weights)) in pages.iter().zip(weights.chunks(KEY_BLOCK)).enumerate() {
            // The first columns' pass asks for the next page's rows, one row per row it sums.
            let next = if at == 0 { pages.get(b + 1).copied() } else { None };
            let mut i = 0;
            while i + 2 <= weights.len() {
                // SAFETY: rows i, i + 1 < KEY_BLOCK, columns below `whole` ≤ d: inside the
                // page (checked above).
                unsafe {
                    add_row(page, next, d, at, &mut even, i, weights[i]);
                    add_row(page, next, d, at, &mut odd, i + 1, weights[i + 1]);
                }
                i += 2;
            }
            if i < weights.len() {
                // SAFETY: as above.
                unsafe { add_row(page, next, d, at, &mut even, i, weights[i]) };
            }
        }
        for l in 0..SUM_WIDTH {
            out[at + l] = even[l] + odd[l];
        }
    }
    // What is left of a head wider than a multiple of the width: the same chains, in memory.
    if whole < d {
        let rest = d - whole;
        let mut chains = vec![0f32; 2 * rest];
        for (j, &w) in weights.iter().enumerate() {
            let (page, first) = (pages[j / KEY_BLOCK], j % KEY_BLOCK * d);
            let chain = &mut chains[(j % 2) * rest..(j % 2 + 1) * rest];
            for (i, o) in chain.iter_mut().enumerate() {
                *o = w.mul_add(page.get(first + whole + i), *o);
            }
        }
        for i in 0..rest {
            out[whole + i] = chains[i] + chains[rest + i];
        }
    }
}

/// `acc += w · row i` of `page`, columns `at..at + SUM_WIDTH`, and asks for the lines of row
/// `i` of `next`. A function, not a closure: a closure is not always inlined into the width's
/// compiled copy, and outside it a multiply-add is a library call.
///
/// # Safety
/// Row `i` holds columns `at..at + SUM_WIDTH` inside `page` (`(i · d + at + SUM_WIDTH` ≤ its
/// length).
#[inline(always)]
unsafe fn add_row<L: Lanes>(page: L, next: Option<L>, d: usize, at: usize, acc: &mut [f32; SUM_WIDTH], i: usize, w: f32) {
    let first = i * d;
    if let Some(next) = next {
        for line in (0..d).step_by(16) {
            next.prefetch(first + line);
        }
    }
    for part in 0..SUM_WIDTH / 16 {
        let v = page.load16_unchecked(first + at + 16 * part);
        for l in 0..16 {
            acc[16 * part + l] = w.mul_add(v[l], acc[16 * part + l]);
        }
    }
}

/// [`Vectors::combine`]: each piece's weights rescaled to the largest score of all its pieces,
/// the sums added in piece order.
#[inline(always)]
fn combine_body(parts: &[f32], d: usize, scale: f32, out: &mut [f32]) {
    let rep = out.len() / d;
    let stride = rep * (2 + d);
    let pieces = parts.len() / stride;
    let mut factors = vec![0f32; pieces];
    for (h, out) in out.chunks_exact_mut(d).enumerate() {
        let part = |piece: usize| &parts[piece * stride + h * (2 + d)..][..2 + d];
        let max = (0..pieces).fold(f32::NEG_INFINITY, |m, piece| m.max(part(piece)[0]));
        factors.iter_mut().enumerate().for_each(|(piece, f)| *f = (part(piece)[0] - max) * scale);
        exp_body(&mut factors);
        let total = factors.iter().enumerate().fold(0f32, |total, (piece, f)| f.mul_add(part(piece)[1], total));
        out.fill(0.0);
        for (piece, f) in factors.iter().enumerate() {
            let w = f / total;
            out.iter_mut().zip(&part(piece)[2..]).for_each(|(o, v)| *o = w.mul_add(*v, *o));
        }
    }
}

/// [`Vectors::exp_below_max`] with the maximum and the sum taken 16 lanes at a time (a fixed
/// order, so the same bits at every width), the exponentials from [`exp_body`].
#[inline(always)]
fn exp_below_max_body(x: &mut [f32], scale: f32) -> (f32, f32) {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = x.chunks_exact(16);
    for chunk in chunks.by_ref() {
        for l in 0..16 {
            lanes[l] = lanes[l].max(chunk[l]);
        }
    }
    let max = chunks.remainder().iter().fold(lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)), |m, &v| m.max(v));
    x.iter_mut().for_each(|v| *v = (*v - max) * scale);
    exp_body(x);
    let mut sums = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for chunk in chunks.by_ref() {
        for l in 0..16 {
            sums[l] += chunk[l];
        }
    }
    (max, sums.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>())
}

/// eˣ as Cephes' `expf` computes it: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`, a degree-7
/// polynomial for eʳ, and 2ⁿ put in the exponent bits. Inputs are clamped to the range whose
/// results are normal floats (softmax and SiLU never need more).
#[inline(always)]
fn exp_body(x: &mut [f32]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1];
    // Adding 1.5 · 2²³ rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    for v in x.iter_mut() {
        let x = v.clamp(-87.3, 88.3);
        let t = x * LOG2E + ROUND;
        let n = t - ROUND;
        let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
        let mut p = P[0];
        for c in &P[1..] {
            p = p.mul_add(r, *c);
        }
        let y = p.mul_add(r * r, r) + 1.0;
        *v = y * f32::from_bits(t.to_bits().wrapping_add(127) << 23);
    }
}

/// `x = eˣ` for every value (see [`Vectors::exp`]).
pub(super) fn exp(x: &mut [f32]) {
    vectors().exp(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp() {
        let inputs: Vec<f32> = (-87_000..88_000).map(|i| i as f32 / 1000.0).chain([0.0, -0.0, 1e-7, -1e-7]).collect();
        for form in [Vectors::Plain, vectors()] {
            let mut got = inputs.clone();
            form.exp(&mut got);
            for (x, y) in inputs.iter().zip(&got) {
                let want = (*x as f64).exp();
                let ulp = (want as f32).to_bits().abs_diff(y.to_bits());
                assert!(ulp <= 2, "exp({x}) = {y}, exact {want}: {ulp} ulp");
            }
        }
    }

    /// Blocks of one layer and one KV head holding `key(p, c)` and `value(p, c)` for
    /// `positions` positions, in f32 or f16; the keys lie at `0..part`, the values after them.
    fn blocks(d: usize, positions: usize, f16: bool, key: impl Fn(usize, usize) -> f32, value: impl Fn(usize, usize) -> f32) -> (Vec<Arc<KvBlock>>, KvLayout) {
        let layout = KvLayout { kv_heads: 1, head_dim: d };
        let blocks = (0..positions.div_ceil(KEY_BLOCK))
            .map(|b| {
                let n = layout.block_len(1);
                let mut buffer = if f16 { KvBuffer::F16(vec![f16::ZERO; n]) } else { KvBuffer::F32(vec![0.0; n]) };
                for p in b * KEY_BLOCK..((b + 1) * KEY_BLOCK).min(positions) {
                    let k: Vec<f32> = (0..d).map(|c| key(p, c)).collect();
                    let v: Vec<f32> = (0..d).map(|c| value(p, c)).collect();
                    layout.write(&mut buffer, 0, 0, p % KEY_BLOCK, &k, &v);
                }
                Arc::new(KvBlock { values: buffer, _live: Tally::default() })
            })
            .collect();
        (blocks, layout)
    }

    /// The vector forms give the bits of the plain one, from f32 and f16 caches alike.
    #[test]
    fn every_vector_width_computes_the_same_bits() {
        let (d, padded, rep) = (72, 48, 3);
        let data = |p: usize, c: usize| (((p * d + c) * 37 % 101) as f32 - 50.0) / 16.0;
        let q: Vec<f32> = (0..rep * d).map(|i| ((i * 53 % 97) as f32 - 48.0) / 23.0).collect();
        let weights: Vec<f32> = (0..padded - 5).map(|i| (i as f32 * 0.37).sin().abs()).collect();
        let caches = [blocks(d, padded, false, data, data).0, blocks(d, padded, true, data, data).0];
        let part = KEY_BLOCK * d;
        for cache in &caches {
            let run = |form: Vectors| {
                let mut scores = vec![0f32; rep * padded];
                form.scores(cache, 0..part, &q, d, &mut scores, padded);
                let mut out = vec![0f32; d];
                form.weighted_sum(cache, part..2 * part, d, &weights, &mut out);
                (scores, out)
            };
            assert_eq!(run(Vectors::Plain), run(vectors()), "{:?}", vectors());
        }
        // f16 holds these values exactly: both caches compute the same.
        let run = |cache: &[Arc<KvBlock>], form: Vectors| {
            let mut scores = vec![0f32; rep * padded];
            form.scores(cache, 0..part, &q, d, &mut scores, padded);
            scores
        };
        assert_eq!(run(&caches[0], Vectors::Plain), run(&caches[1], vectors()));
        // Combining pieces: three pieces' parts of `rep` heads.
        let parts: Vec<f32> = (0..3 * rep * (2 + d)).map(|i| if i % (2 + d) < 2 { 1.0 + (i % 5) as f32 } else { ((i * 41 % 89) as f32 - 44.0) / 9.0 }).collect();
        let combined = |form: Vectors| {
            let mut out = vec![0f32; rep * d];
            form.combine(&parts, d, 0.125, &mut out);
            out
        };
        assert_eq!(combined(Vectors::Plain), combined(vectors()), "{:?}", vectors());
    }

    /// Scores and sums over several blocks are the plain dot products and weighted sums, up to
    /// rounding.
    #[test]
    fn scores_and_sums_are_what_they_say() {
        let (d, blocks_n, rep) = (64, 3, 2);
        let padded = blocks_n * KEY_BLOCK;
        let key = |p: usize, c: usize| ((p * 31 + c * 7) % 13) as f32 - 6.0;
        let (cache, layout) = blocks(d, padded, false, key, |_, _| 0.0);
        let q: Vec<f32> = (0..rep * d).map(|i| (i % 5) as f32 - 2.0).collect();
        let mut scores = vec![0f32; rep * padded];
        vectors().scores(&cache, 0..layout.part_len(), &q, d, &mut scores, padded);
        for h in 0..rep {
            for p in 0..padded {
                let want: f32 = (0..d).map(|c| q[h * d + c] * key(p, c)).sum();
                assert_eq!(scores[h * padded + p], want, "head {h} position {p}");
            }
        }
        for d in [64, 80] {
            let value = |p: usize, c: usize| ((p * d + c) % 9) as f32;
            // 21 positions: the rows run into a second block.
            let weights: Vec<f32> = (0..21).map(|j| [0.5, 0.25, 1.0, 2.0, 0.125][j % 5]).collect();
            let (cache, layout) = blocks(d, weights.len(), false, |_, _| 0.0, value);
            let mut out = vec![9f32; d];
            let part = layout.part_len();
            vectors().weighted_sum(&cache, part..2 * part, d, &weights, &mut out);
            for c in 0..d {
                let want: f32 = weights.iter().enumerate().map(|(j, w)| w * value(j, c)).sum();
                assert_eq!(out[c], want, "d {d} column {c}");
            }
        }
    }

    /// Attention over a context of several pieces is exact attention up to rounding, with
    /// the largest scores in a later piece than the first; and a query's bits depend only on
    /// what it sees: alone or beside others, on one thread or the team.
    #[test]
    fn pieces_combine_into_exact_attention() {
        let (d, rep, positions) = (64, 3, 3 * PIECE + 37);
        // Keys along a slow wave, so each piece has its own largest score.
        let key = |p: usize, c: usize| ((p as f32 / 97.0).sin() * 3.0 + (c % 7) as f32 / 7.0) * if c % 2 == 0 { 1.0 } else { -0.5 };
        let value = |p: usize, c: usize| (((p * 31 + c * 17) % 23) as f32 - 11.0) / 5.0;
        let (cache, layout) = blocks(d, positions, false, key, value);
        let q: Vec<f32> = (0..rep * d).map(|i| ((i * 29 % 19) as f32 - 9.0) / 4.0).collect();
        let query = |seen: usize| Query { blocks: &cache, layout, layer: 0, seen };
        let alone = |seen: usize, q: &[f32]| {
            let mut out = vec![0f32; rep * d];
            attend(&[query(seen)], rep, 1, d, q, &mut out, &Team::solo());
            out
        };
        for seen in [1, PIECE, PIECE + 1, positions] {
            let got = alone(seen, &q);
            for h in 0..rep {
                let scores: Vec<f64> = (0..seen).map(|p| (0..d).map(|c| q[h * d + c] as f64 * key(p, c) as f64).sum::<f64>() / (d as f64).sqrt()).collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for c in 0..d {
                    let want = weights.iter().enumerate().map(|(p, w)| w * value(p, c) as f64).sum::<f64>() / total;
                    let error = (got[h * d + c] as f64 - want).abs();
                    assert!(error <= 1e-5 * (1.0 + want.abs()), "seen {seen}, head {h}, column {c}: {} against {want}", got[h * d + c]);
                }
            }
        }
        // A prefill's queries of one sequence, together on the team, in more than one pass
        // (ITEMS_PER_PASS): each gets the bits it gets alone on one thread.
        let seens: Vec<usize> = [300, 600].into_iter().chain((0..200).map(|i| positions - 200 + i)).collect();
        assert!(seens.iter().map(|s| s.div_ceil(PIECE)).sum::<usize>() > ITEMS_PER_PASS);
        // Each query its own: a query's heads scaled by its place.
        let qs: Vec<f32> = (0..seens.len()).flat_map(|i| q.iter().map(move |v| v * (1.0 + i as f32 / 64.0))).collect();
        let mut together = vec![0f32; seens.len() * rep * d];
        let queries: Vec<Query> = seens.iter().map(|&seen| query(seen)).collect();
        Team::run(|team| attend(&queries, rep, 1, d, &qs, &mut together, team));
        for (i, &seen) in seens.iter().enumerate() {
            let rows = i * rep * d..(i + 1) * rep * d;
            assert_eq!(together[rows.clone()], alone(seen, &qs[rows])[..], "query {i}, seen {seen}");
        }
    }
}
