//! What the batching tests compare a batched step with.

use headroom_model::{Decoder, LlamaConfig};

/// Each prompt fed alone, then `steps` tokens `token(sequence, step)` one at a time: the logits
/// of every step, per sequence.
pub fn lone_steps<M: Decoder>(model: &M, config: &LlamaConfig, prompts: &[Vec<u32>], steps: usize, token: impl Fn(usize, usize) -> u32) -> Vec<Vec<Vec<f32>>> {
    prompts
        .iter()
        .enumerate()
        .map(|(s, prompt)| {
            let mut cache = model.new_cache(config, prompt.len() + steps);
            model.feed(prompt, &mut cache);
            (0..steps).map(|i| model.feed(&[token(s, i)], &mut cache)).collect()
        })
        .collect()
}
