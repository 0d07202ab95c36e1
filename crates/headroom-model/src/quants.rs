//! ggml tensor types and their dequantization, following the block layouts GGUF files store
//! (ggml's `block_q4_0` … `block_q6_K`). Every block starts or ends with f16 scales; each function
//! below documents its layout. The Python `gguf` package's `gguf.quants` is the independent
//! reference the tests compare against (tests/reference).

use half::{bf16, f16};

/// Values per super-block of the K-quants.
const QK_K: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    BF16 = 30,
}

pub const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Names of ggml types Headroom does not read, for a clear error.
fn unsupported_name(id: u32) -> Option<&'static str> {
    Some(match id {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        _ => return None,
    })
}

impl GgmlType {
    pub fn from_id(id: u32) -> Result<Self, String> {
        SUPPORTED.iter().copied().find(|t| *t as u32 == id).ok_or_else(|| {
            let name = unsupported_name(id).map(str::to_owned).unwrap_or_else(|| format!("unknown type id {id}"));
            let list: Vec<String> = SUPPORTED.iter().map(ToString::to_string).collect();
            format!(
                "type {name}, which Headroom does not read (supported: {}); re-quantize the model to one of those",
                list.join(", ")
            )
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Values per block.
    pub fn block_elements(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
            _ => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Average bits per weight, for sizes in the plan.
    pub fn bits_per_weight(self) -> f64 {
        self.block_bytes() as f64 * 8.0 / self.block_elements() as f64
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes `elements` values of type `ty` from `bytes`.
pub fn dequantize(ty: GgmlType, bytes: &[u8], elements: usize) -> Result<Vec<f32>, String> {
    let block = ty.block_elements();
    if elements % block != 0 {
        return Err(format!("{elements} values are not a whole number of {ty} blocks of {block}"));
    }
    let need = elements / block * ty.block_bytes();
    if bytes.len() != need {
        return Err(format!("{elements} {ty} values need {need} bytes, the data has {}", bytes.len()));
    }
    let mut out = vec![0f32; elements];
    if elements == 0 {
        return Ok(out);
    }
    let blocks = bytes.chunks_exact(ty.block_bytes()).zip(out.chunks_exact_mut(block));
    match ty {
        GgmlType::F32 => {
            for (b, y) in blocks {
                y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = f16_at(b, 0)),
        GgmlType::BF16 => blocks.for_each(|(b, y)| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        GgmlType::Q2K => blocks.for_each(|(b, y)| q2_k(b, y)),
        GgmlType::Q3K => blocks.for_each(|(b, y)| q3_k(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(b, y)| q5_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| q6_k(b, y)),
    }
    Ok(out)
}

/// `d: f16, qs: [u8; 16]`: value j is the low nibble of qs[j] (j < 16) or the high nibble of
/// qs[j - 16], minus 8, times d.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// `d: f16, m: f16, qs: [u8; 16]`: nibble × d + m.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0f) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The fifth bits of a Q5 block: bit j of the little-endian u32 `qh` belongs to value j.
fn fifth_bits(qh: &[u8], j: usize) -> (u8, u8) {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let lo = ((qh >> j) & 1) as u8;
    // The negative control of the reference test reads the second half's bits from the first.
    let hi_bit = if crate::test_defect("q5-high-bits") { j } else { j + 16 };
    let hi = ((qh >> hi_bit) & 1) as u8;
    (lo << 4, hi << 4)
}

/// `d: f16, qh: [u8; 4], qs: [u8; 16]`: (nibble | fifth bit << 4) − 16, times d.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let (qh, qs) = (&b[2..6], &b[6..22]);
    for j in 0..16 {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = (((qs[j] & 0x0f) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

/// `d: f16, m: f16, qh: [u8; 4], qs: [u8; 16]`: (nibble | fifth bit << 4) × d + m.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let (qh, qs) = (&b[4..8], &b[8..24]);
    for j in 0..16 {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = ((qs[j] & 0x0f) | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) | h1) as f32 * d + m;
    }
}

/// `d: f16, qs: [i8; 32]`: qs × d.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..34]) {
        *v = q as i8 as f32 * d;
    }
}

/// `scales: [u8; 16]` (low nibble scale, high nibble min, per 16 values), `qs: [u8; 64]` (2 bits
/// each), `d: f16, dmin: f16`. Each 128 values read 32 bytes of qs at shifts 0, 2, 4, 6.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for step in 0..4 {
            let shift = 2 * step;
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
                for l in 0..16 {
                    let out = half * 128 + step * 32 + part * 16 + l;
                    y[out] = dl * ((q[part * 16 + l] >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

/// `hmask: [u8; 32]` (third bits), `qs: [u8; 64]` (low 2 bits), `scales: [u8; 12]` (16 six-bit
/// scales, offset by 32), `d: f16`. A value whose hmask bit is clear has 4 subtracted.
fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    // Scale i: low 4 bits from packed[i % 8] (low nibble for i < 8, high for i ≥ 8), high 2 bits
    // from packed[8 + i % 4] at bit 2 * (i / 4).
    let scale = |i: usize| -> f32 {
        let low = if i < 8 { packed[i] & 0x0f } else { packed[i - 8] >> 4 };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        ((low | (high << 4)) as i32 - 32) as f32
    };
    let mut is = 0;
    let mut bit = 1u8;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for step in 0..4 {
            let shift = 2 * step;
            for part in 0..2 {
                let dl = d * scale(is);
                is += 1;
                for l in 0..16 {
                    let k = part * 16 + l;
                    let high = if hmask[k] & bit != 0 { 0 } else { 4 };
                    y[half * 128 + step * 32 + k] = dl * (((q[k] >> shift) & 3) as i32 - high) as f32;
                }
            }
            bit <<= 1;
        }
    }
}

/// The eight scales and eight mins of a Q4_K/Q5_K super-block, six bits each packed in 12 bytes:
/// sub-blocks 0–3 keep theirs in the low six bits of bytes 0–3 (scales) and 4–7 (mins);
/// sub-blocks 4–7 have their low four bits in bytes 8–11 (scale low nibble, min high nibble) and
/// their top two bits in the top bits of bytes 0–3 (scales) and 4–7 (mins). Decoded four at a
/// time in 32-bit words, without branches (the CPU kernels call this once per super-block).
#[inline]
pub(crate) fn scales_mins_k4(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes([q[i], q[i + 1], q[i + 2], q[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let scales_hi = (c & LOW4) | (((a >> 6) & LOW2) << 4);
    let mins_hi = ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4);
    // One 64-bit value, not two 32-bit halves written apart: the SIMD kernels load the eight
    // bytes at once, and a load spanning two earlier stores cannot be forwarded from them (it
    // waits for both to reach the cache: half of a Q4_K decode step's time, measured with perf).
    let join = |lo: u32, hi: u32| ((hi as u64) << 32 | lo as u64).to_le_bytes();
    (join(a & LOW6, scales_hi), join(b & LOW6, mins_hi))
}

/// `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`: eight sub-blocks of 32, each
/// nibble × d × scale − dmin × min; 32 bytes of qs hold two sub-blocks (low, then high nibbles).
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    let (sc, mn) = scales_mins_k4(scales);
    for pair in 0..4 {
        let q = &qs[pair * 32..pair * 32 + 32];
        let (s1, m1) = (sc[2 * pair] as f32, mn[2 * pair] as f32);
        let (s2, m2) = (sc[2 * pair + 1] as f32, mn[2 * pair + 1] as f32);
        for l in 0..32 {
            y[pair * 64 + l] = d * s1 * (q[l] & 0x0f) as f32 - dmin * m1;
            y[pair * 64 + 32 + l] = d * s2 * (q[l] >> 4) as f32 - dmin * m2;
        }
    }
}

/// `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`: as Q4_K with a fifth
/// bit per value from qh (bit 2·pair for the low nibbles, 2·pair + 1 for the high).
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    let (sc, mn) = scales_mins_k4(scales);
    for pair in 0..4 {
        let q = &qs[pair * 32..pair * 32 + 32];
        let (s1, m1) = (sc[2 * pair] as f32, mn[2 * pair] as f32);
        let (s2, m2) = (sc[2 * pair + 1] as f32, mn[2 * pair + 1] as f32);
        let (u1, u2) = (1u8 << (2 * pair), 1u8 << (2 * pair + 1));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[pair * 64 + l] = d * s1 * ((q[l] & 0x0f) + h1) as f32 - dmin * m1;
            y[pair * 64 + 32 + l] = d * s2 * ((q[l] >> 4) + h2) as f32 - dmin * m2;
        }
    }
}

/// `ql: [u8; 128]` (low 4 bits), `qh: [u8; 64]` (high 2 bits), `scales: [i8; 16]`, `d: f16`:
/// (6-bit value − 32) × d × scale. Each 128 values read 64 bytes of ql and 32 of qh.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql_all, qh_all, sc_all) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &ql_all[half * 64..half * 64 + 64];
        let qh = &qh_all[half * 32..half * 32 + 32];
        let sc = &sc_all[half * 8..half * 8 + 8];
        let out = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * sc[is] as i8 as f32 * q1 as f32;
            out[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            out[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            out[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
    }
}

/// Quantizes f32 values to Q8_0 (round to nearest, scale = max |x| / 127), the layout above; for
/// fixtures written by the tests.
pub fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    assert!(values.len() % 32 == 0, "Q8_0 needs whole blocks of 32");
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|v| (v * inv).round() as i8 as u8));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_round_trips_within_half_a_step() {
        let values: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 32.0) / 10.0).collect();
        let back = dequantize(GgmlType::Q8_0, &quantize_q8_0(&values), 64).unwrap();
        for (a, b) in values.iter().zip(&back) {
            assert!((a - b).abs() <= 3.2 / 127.0 * 0.51 + 1e-3, "{a} vs {b}");
        }
    }

    #[test]
    fn q4_0_block_by_hand() {
        // d = 0.5; qs[0] = 0x9F: value 0 is 15 − 8 = 7, value 16 is 9 − 8 = 1.
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        block[2] = 0x9f;
        let y = dequantize(GgmlType::Q4_0, &block, 32).unwrap();
        assert_eq!((y[0], y[16], y[1]), (3.5, 0.5, -4.0));
    }

    #[test]
    fn wrong_sizes_and_unknown_types_are_clear_errors() {
        let err = dequantize(GgmlType::Q4K, &[0; 10], 256).unwrap_err();
        assert!(err.contains("need 144 bytes"), "{err}");
        let err = GgmlType::from_id(23).unwrap_err();
        assert!(err.contains("IQ4_XS") && err.contains("Q4_K"), "{err}");
    }
}
