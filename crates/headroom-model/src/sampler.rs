//! Host-side sampling from f32 logits. The RNG is ChaCha20 with a recorded stream position, so a
//! [`SamplerState`] restores sampling exactly where it stopped.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// 1.0 means no penalty (Hugging Face / CTRL style: divides positive logits).
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::InvalidRequest(format!(
                "temperature must be a number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidRequest(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(Error::InvalidRequest(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            )));
        }
        Ok(())
    }
}

/// Everything needed to continue sampling: the parameters and the RNG's position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplerState {
    pub params: SamplingParams,
    /// ChaCha20 word position (u128 as a string keeps JSON lossless).
    pub rng_word_pos: String,
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = ChaCha20Rng::seed_from_u64(params.seed);
        Self { params, rng }
    }

    /// Greedy with no penalty: the next token is the logits' argmax, which a GPU can pick
    /// without handing the logits to the host (no random draw is used, so the state is kept).
    pub fn is_plain_greedy(&self) -> bool {
        self.params.temperature == 0.0 && self.params.repetition_penalty == 1.0
    }

    pub fn from_state(state: &SamplerState) -> Result<Self> {
        let pos: u128 = state
            .rng_word_pos
            .parse()
            .map_err(|_| Error::InvalidRequest("checkpoint has a corrupt sampler state".into()))?;
        let mut sampler = Self::new(state.params.clone());
        sampler.rng.set_word_pos(pos);
        Ok(sampler)
    }

    pub fn state(&self) -> SamplerState {
        SamplerState {
            params: self.params.clone(),
            rng_word_pos: self.rng.get_word_pos().to_string(),
        }
    }

    /// Picks the next token. `context` is every token so far (prompt and generated), used by the
    /// repetition penalty.
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in context {
                if seen.insert(t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = if *l > 0.0 {
                            *l / p.repetition_penalty
                        } else {
                            *l * p.repetition_penalty
                        };
                    }
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        // Sort by logit, ties by token id so the order is deterministic.
        candidates.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < candidates.len() {
            candidates.truncate(p.top_k);
        }
        let max = candidates[0].1;
        let mut probs: Vec<f32> = candidates.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let mut keep = probs.len();
            for (i, &prob) in probs.iter().enumerate() {
                cumulative += prob;
                if cumulative >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let sum: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= sum);
        }
        // Always draw exactly one number per step, so the RNG position counts steps.
        let draw: f32 = self.rng.random();
        let mut cumulative = 0.0;
        for (i, prob) in probs.iter().enumerate() {
            cumulative += prob;
            if draw < cumulative {
                return candidates[i].0;
            }
        }
        candidates[probs.len() - 1].0
    }
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_largest() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0], &[]), 1);
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 4.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&mut [2.0, 1.0], &[0]), 1);
    }

    #[test]
    fn restored_state_continues_the_same_stream() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 50,
            top_p: 0.9,
            seed: 7,
            ..Default::default()
        };
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut straight = Sampler::new(params.clone());
        let first: Vec<u32> = (0..5).map(|_| straight.sample(&mut logits.clone(), &[])).collect();
        let state = straight.state();
        let rest: Vec<u32> = (0..5).map(|_| straight.sample(&mut logits.clone(), &[])).collect();
        let mut resumed = Sampler::from_state(&state).unwrap();
        let again: Vec<u32> = (0..5).map(|_| resumed.sample(&mut logits.clone(), &[])).collect();
        assert_eq!(rest, again);
        assert_ne!(first.len(), 0);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.5,
            top_k: 1,
            seed: 3,
            ..Default::default()
        });
        for _ in 0..10 {
            assert_eq!(s.sample(&mut [0.0, 0.5, 0.4], &[]), 1);
        }
    }
}
