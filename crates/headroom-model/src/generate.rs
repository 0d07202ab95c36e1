//! Generation: chunked prefill, then one decode step per token over a KV cache sized for the
//! whole request (prompt + max_tokens) up front. A [`Checkpoint`] captures the prompt, the tokens
//! generated and the sampler state; a session resumed from it produces exactly the tokens a
//! straight run would have (on the same backend).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use crate::bundle::ModelBundle;
use crate::model::{KvCache, Llama, RopeTables};
use crate::sampler::{Sampler, SamplerState, SamplingParams};
use crate::{Error, Result};

/// Cheap to clone; checked before every prefill chunk and every decode step.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub prompt_tokens: Vec<u32>,
    pub generated_tokens: Vec<u32>,
    /// Text already delivered to the client (the resumed stream continues after it).
    pub delivered_text: String,
    pub sampler: SamplerState,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub prompt_tokens: Vec<u32>,
    /// Tokens to generate at most, counting those already in a resume checkpoint.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    #[serde(default)]
    pub stop: Vec<String>,
    /// Tokens fed per prefill step; bounds the activation workspace.
    #[serde(default = "default_prefill_chunk")]
    pub prefill_chunk: usize,
    #[serde(default)]
    pub resume: Option<Checkpoint>,
    /// Generate exactly max_tokens even past EOS (benchmarks and tests, like vLLM's `ignore_eos`).
    #[serde(default)]
    pub ignore_eos: bool,
    /// What the prompt tokens were made from, and by which bundle's tokenizer: a worker holding
    /// another model (a fallback) makes its own tokens from it.
    #[serde(default)]
    pub source: Option<PromptSource>,
    /// Embed the prompt instead of generating (`max_tokens` is 0): the mean of its tokens'
    /// hidden states after the final norm, scaled to length 1 (see [`Session::embedding`]).
    #[serde(default)]
    pub embed: bool,
}

/// The client's prompt before tokenization, and the bundle whose tokenizer (and chat template)
/// turned it into `prompt_tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptSource {
    pub bundle_hash: String,
    pub input: PromptInput,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PromptInput {
    /// Messages (and tools), rendered through the bundle's chat template.
    Chat { messages: Vec<crate::ChatMessage>, tools: Option<serde_json::Value> },
    /// A plain completion prompt.
    Text { text: String },
}

pub fn default_prefill_chunk() -> usize {
    256
}

impl GenerateRequest {
    pub fn new(prompt_tokens: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        Self {
            prompt_tokens,
            max_tokens,
            sampling,
            stop: Vec::new(),
            prefill_chunk: default_prefill_chunk(),
            resume: None,
            ignore_eos: false,
            source: None,
            embed: false,
        }
    }

    /// A request to embed `prompt_tokens` (see [`GenerateRequest::embed`]).
    pub fn embedding(prompt_tokens: Vec<u32>) -> Self {
        Self { embed: true, ..Self::new(prompt_tokens, 0, SamplingParams::default()) }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// max_tokens reached.
    Length,
    Cancelled,
}

/// One streamed token and the text it made final (empty while a UTF-8 character or a possible
/// stop string is still incomplete).
#[derive(Debug, Clone)]
pub struct StreamEvent<'a> {
    pub token: u32,
    pub index: usize,
    pub text: &'a str,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values an earlier request had computed (not fed).
    pub prompt_reused: usize,
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// Decode steps timed in `decode_ms` (the first token comes from prefill).
    pub decode_steps: usize,
    pub checkpoint: Checkpoint,
}

impl Generation {
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_steps as f64 / (self.decode_ms / 1000.0).max(1e-9)
    }
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / (self.prefill_ms / 1000.0).max(1e-9)
    }
}

/// A model a [`Session`] runs: burn's [`Llama`] on any backend, or the CPU engine
/// ([`crate::cpu::CpuModel`]). Each keeps its KV cache its own way.
pub trait Decoder {
    type Cache;
    /// A KV cache for `capacity` tokens (prompt + max_tokens).
    fn new_cache(&self, config: &crate::LlamaConfig, capacity: usize) -> Self::Cache;
    /// A KV cache for a request whose prompt is `prompt`, already holding what the model kept
    /// of an earlier sequence that began the same way, and how many of the prompt's tokens it
    /// holds (never all of them). A model that keeps nothing gives an empty cache.
    fn cache_for_prompt(&self, config: &crate::LlamaConfig, prompt: &[u32], capacity: usize) -> (Self::Cache, usize) {
        let _ = prompt;
        (self.new_cache(config, capacity), 0)
    }
    /// Takes a finished sequence's cache back (it is left empty); `tokens` are the tokens it
    /// holds, in order. A model that keeps nothing drops it.
    fn retire(&self, cache: &mut Self::Cache, tokens: &[u32]) {
        let _ = (cache, tokens);
    }
    /// Feeds `tokens` at the cache's position and returns the logits of the last.
    fn feed(&self, tokens: &[u32], cache: &mut Self::Cache) -> Vec<f32>;
    /// Feeds `tokens` at the cache's position and gives the sum of their hidden states after the
    /// final norm (`hidden_size` values): what an embedding pools.
    fn feed_pooled(&self, tokens: &[u32], cache: &mut Self::Cache) -> Vec<f32>;
    /// Feeds one token to each of several sequences (each its own cache) and gives each one's
    /// logits, exactly what [`Decoder::feed`] of that token alone returns, or, where `pick[i]`
    /// (the sequence samples greedily) and the model runs on a device, the most likely token
    /// picked there: only its id then crosses to the host, not a vocabulary of logits. A model
    /// that cannot batch feeds them one after another.
    fn feed_batch(&self, batch: &mut [(u32, &mut Self::Cache)], pick: &[bool]) -> Vec<Next> {
        let _ = pick;
        batch.iter_mut().map(|(token, cache)| Next::Logits(self.feed(&[*token], cache))).collect()
    }
    /// Whether a batch step may pool every waiting prompt at once with
    /// [`Decoder::feed_pooled_many`]: an encoder, whose prompts are read whole and never
    /// generate. Otherwise a step feeds one prompt chunk.
    fn pools_prompts_together(&self) -> bool {
        false
    }
    /// [`Decoder::feed_pooled`] of several prompts, each with its own cache: an encoder
    /// multiplies all their rows together, reading each weight once for all of them. One after
    /// another where the model cannot.
    fn feed_pooled_many(&self, prompts: &mut [(&[u32], &mut Self::Cache)]) -> Vec<Vec<f32>> {
        prompts.iter_mut().map(|(tokens, cache)| self.feed_pooled(tokens, cache)).collect()
    }
}

/// What a decode step gives a sequence: the logits of its next token, or the token itself where
/// the model picked it (see [`Decoder::feed_batch`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    Logits(Vec<f32>),
    Token(u32),
}

/// burn's KV cache and the RoPE tables for its positions.
pub struct BurnCache<B: Backend> {
    rope: RopeTables<B>,
    kv: KvCache<B>,
}

impl<B: Backend> Decoder for Llama<B> {
    type Cache = BurnCache<B>;
    fn new_cache(&self, config: &crate::LlamaConfig, capacity: usize) -> BurnCache<B> {
        let device = self.embed_tokens.weight.device();
        BurnCache { rope: RopeTables::new(config, capacity, &device), kv: KvCache::new(config, capacity) }
    }
    fn feed(&self, tokens: &[u32], cache: &mut BurnCache<B>) -> Vec<f32> {
        self.step(tokens, &cache.rope, &mut cache.kv)
    }
    fn feed_pooled(&self, tokens: &[u32], cache: &mut BurnCache<B>) -> Vec<f32> {
        self.step_pooled(tokens, &cache.rope, &mut cache.kv)
    }
    fn feed_batch(&self, batch: &mut [(u32, &mut BurnCache<B>)], pick: &[bool]) -> Vec<Next> {
        let mut batch: Vec<(u32, &RopeTables<B>, &mut KvCache<B>)> =
            batch.iter_mut().map(|(token, cache)| (*token, &cache.rope, &mut cache.kv)).collect();
        self.step_batch(&mut batch, pick)
    }
}

impl Decoder for crate::cpu::CpuModel {
    type Cache = crate::cpu::CpuCache;
    fn new_cache(&self, _config: &crate::LlamaConfig, capacity: usize) -> crate::cpu::CpuCache {
        crate::cpu::CpuModel::new_cache(self, capacity)
    }
    fn cache_for_prompt(&self, _config: &crate::LlamaConfig, prompt: &[u32], capacity: usize) -> (crate::cpu::CpuCache, usize) {
        let cache = crate::cpu::CpuModel::cache_for_prompt(self, prompt, capacity);
        let held = cache.len;
        (cache, held)
    }
    fn retire(&self, cache: &mut crate::cpu::CpuCache, tokens: &[u32]) {
        crate::cpu::CpuModel::retire(self, cache, tokens)
    }
    fn feed(&self, tokens: &[u32], cache: &mut crate::cpu::CpuCache) -> Vec<f32> {
        self.step(tokens, cache)
    }
    fn feed_pooled(&self, tokens: &[u32], cache: &mut crate::cpu::CpuCache) -> Vec<f32> {
        self.step_pooled(tokens, cache)
    }
    /// Always logits: on the CPU the sampler's argmax is as cheap as picking here.
    fn feed_batch(&self, batch: &mut [(u32, &mut crate::cpu::CpuCache)], _pick: &[bool]) -> Vec<Next> {
        self.step_batch(batch).into_iter().map(Next::Logits).collect()
    }
}

/// A running generation on one model.
pub struct Session<'m, M: Decoder> {
    model: &'m M,
    bundle: &'m ModelBundle,
    cache: M::Cache,
    sampler: Sampler,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    max_tokens: usize,
    stop: Vec<String>,
    ignore_eos: bool,
    /// Text of `generated` decoded so far and the part already handed out.
    text: String,
    delivered: usize,
    /// Logits for the next token, or the token where the model picked it.
    next: Option<Next>,
    finished: Option<FinishReason>,
    pub prefill_ms: f64,
    /// Prompt tokens fed so far (those the cache started with included), and how many per
    /// prefill step.
    prompt_fed: usize,
    /// Prompt tokens the cache started with: computed by an earlier request.
    prompt_reused: usize,
    prefill_chunk: usize,
    /// Tokens of a resumed checkpoint (the head of `generated`), and how many were fed again.
    resumed: usize,
    replayed: usize,
    /// The token sampled last, to be fed before the next can be sampled.
    unfed: Option<u32>,
    /// When the first prompt token was fed (prefill time runs from there).
    prefill_started: Option<Instant>,
    /// An embedding's sum of the prompt's final hidden states so far; `None` for a generation.
    pooled: Option<Vec<f32>>,
}

/// What a [`Session`] needs next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    /// A chunk of the prompt (`prompt[range]`), fed in one step of its own.
    Prefill(std::ops::Range<usize>),
    /// One token (the last sampled, or one of a resumed checkpoint's), which may share a batched
    /// step with other sessions' tokens.
    Decode(u32),
    /// Logits are ready: the next token can be sampled.
    Sample,
    Finished,
}

/// Checks an embedding request: a prompt of at least one token that fits the context, nothing to
/// generate.
pub fn check_embedding(request: &GenerateRequest, context: usize) -> Result<()> {
    let tokens = request.prompt_tokens.len();
    if tokens == 0 {
        return Err(Error::InvalidRequest("the input to embed is empty".into()));
    }
    if request.max_tokens != 0 || request.resume.is_some() {
        return Err(Error::InvalidRequest("an embedding generates nothing: max_tokens must be 0, with no checkpoint".into()));
    }
    if tokens > context {
        return Err(Error::InvalidRequest(format!(
            "the input has {tokens} tokens, but the model embeds at most {context}; shorten it or split it into several inputs"
        )));
    }
    Ok(())
}

/// Checks the context limit and says exactly how much fits.
pub fn check_context(prompt_tokens: usize, max_tokens: usize, context: usize) -> Result<()> {
    if prompt_tokens == 0 {
        return Err(Error::InvalidRequest("the prompt is empty".into()));
    }
    if max_tokens == 0 {
        return Err(Error::InvalidRequest("max_tokens must be at least 1".into()));
    }
    if prompt_tokens + max_tokens > context {
        return Err(Error::ContextOverflow {
            prompt_tokens,
            max_tokens,
            context,
            available: context.saturating_sub(prompt_tokens),
        });
    }
    Ok(())
}

impl<'m, M: Decoder> Session<'m, M> {
    /// Allocates the KV cache and runs the prefill (or replays a checkpoint).
    pub fn start(
        model: &'m M,
        bundle: &'m ModelBundle,
        request: &GenerateRequest,
        cancel: &CancelToken,
    ) -> Result<Self> {
        let mut session = Self::new(model, bundle, request)?;
        loop {
            match session.work() {
                Work::Prefill(_) | Work::Decode(_) if cancel.is_cancelled() => {
                    session.finished = Some(FinishReason::Cancelled);
                    return Ok(session);
                }
                Work::Prefill(_) => session.feed_prefill(),
                // Replaying generated tokens one decode step at a time repeats the straight
                // run's arithmetic exactly, so the resumed stream is token-for-token the same.
                Work::Decode(token) => {
                    let pick = session.picks_on_device();
                    let next = model.feed_batch(&mut [(token, &mut session.cache)], &[pick]).pop().expect("one sequence fed");
                    session.fed(next);
                }
                Work::Sample | Work::Finished => return Ok(session),
            }
        }
    }

    /// Checks the request and allocates the KV cache; computes nothing yet (see [`Self::work`]).
    pub fn new(model: &'m M, bundle: &'m ModelBundle, request: &GenerateRequest) -> Result<Self> {
        request.sampling.validate()?;
        let context = bundle.config.max_position_embeddings;
        if bundle.config.is_encoder() && !request.embed {
            return Err(Error::InvalidRequest(format!("{} is an embedding model (an encoder): it embeds text and generates nothing", bundle.name())));
        }
        if request.embed {
            check_embedding(request, context)?;
        } else {
            check_context(request.prompt_tokens.len(), request.max_tokens, context)?;
        }
        let vocab = bundle.config.vocab_size as u32;
        if let Some(bad) = request.prompt_tokens.iter().find(|&&t| t >= vocab) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        if request.stop.iter().any(String::is_empty) {
            return Err(Error::InvalidRequest("stop strings must not be empty".into()));
        }
        let (sampler, generated, delivered_text) = match &request.resume {
            Some(cp) => {
                if cp.prompt_tokens != request.prompt_tokens {
                    return Err(Error::InvalidRequest(
                        "the checkpoint belongs to a different prompt".into(),
                    ));
                }
                if cp.generated_tokens.len() >= request.max_tokens {
                    return Err(Error::InvalidRequest(
                        "the checkpoint already holds max_tokens tokens".into(),
                    ));
                }
                (
                    Sampler::from_state(&cp.sampler)?,
                    cp.generated_tokens.clone(),
                    cp.delivered_text.clone(),
                )
            }
            None => (Sampler::new(request.sampling.clone()), Vec::new(), String::new()),
        };
        let (text, delivered) = if generated.is_empty() {
            (String::new(), 0)
        } else {
            let text = bundle.decode(&generated)?;
            let delivered = delivered_text.len().min(text.len());
            (text, delivered)
        };
        let capacity = request.prompt_tokens.len() + request.max_tokens;
        // An embedding pools every prompt token's hidden state, so it computes them all.
        let (cache, prompt_held) = if request.embed {
            (model.new_cache(&bundle.config, capacity), 0)
        } else {
            model.cache_for_prompt(&bundle.config, &request.prompt_tokens, capacity)
        };
        Ok(Self {
            model,
            bundle,
            cache,
            sampler,
            prompt: request.prompt_tokens.clone(),
            resumed: generated.len(),
            generated,
            max_tokens: request.max_tokens,
            stop: request.stop.clone(),
            ignore_eos: request.ignore_eos,
            text,
            delivered,
            next: None,
            finished: None,
            prefill_ms: 0.0,
            prompt_fed: prompt_held,
            prompt_reused: prompt_held,
            // An encoder's tokens attend to later ones too: its prompt goes in whole.
            prefill_chunk: if bundle.config.is_encoder() { request.prompt_tokens.len().max(1) } else { request.prefill_chunk.max(1) },
            replayed: 0,
            unfed: None,
            prefill_started: None,
            pooled: request.embed.then(|| vec![0.0; bundle.config.hidden_size]),
        })
    }

    /// What this session needs next: the prompt in chunks, then the checkpoint's tokens one at
    /// a time (a resume), then a sample and a decode step per token.
    pub fn work(&self) -> Work {
        if self.finished.is_some() {
            Work::Finished
        } else if self.prompt_fed < self.prompt.len() {
            Work::Prefill(self.prompt_fed..(self.prompt_fed + self.prefill_chunk).min(self.prompt.len()))
        } else if self.replayed < self.resumed {
            Work::Decode(self.generated[self.replayed])
        } else if let Some(token) = self.unfed {
            Work::Decode(token)
        } else {
            Work::Sample
        }
    }

    /// Feeds the next prompt chunk (when [`Self::work`] is `Prefill`).
    pub fn feed_prefill(&mut self) {
        let Work::Prefill(range) = self.work() else { panic!("no prompt left to feed") };
        self.prefill_started.get_or_insert_with(Instant::now);
        if self.pooled.is_some() {
            let sum = self.model.feed_pooled(&self.prompt[range.clone()], &mut self.cache);
            self.add_pooled(range.end, sum);
            return;
        }
        let logits = self.model.feed(&self.prompt[range], &mut self.cache);
        self.fed(Next::Logits(logits));
    }

    /// An embedding's next prompt chunk and its cache, for a step that pools several sessions'
    /// chunks at once ([`Decoder::feed_pooled_many`]); then [`Self::pooled_fed`].
    pub(crate) fn pooled_input(&mut self) -> Option<(&[u32], &mut M::Cache)> {
        match self.work() {
            Work::Prefill(range) if self.pooled.is_some() => Some((&self.prompt[range], &mut self.cache)),
            _ => None,
        }
    }

    /// Takes the pooled sum of the chunk [`Self::pooled_input`] gave.
    pub(crate) fn pooled_fed(&mut self, sum: Vec<f32>) {
        let Work::Prefill(range) = self.work() else { panic!("no prompt left to feed") };
        self.prefill_started.get_or_insert_with(Instant::now);
        self.add_pooled(range.end, sum);
    }

    /// Adds a chunk's pooled sum; the chunk ended at prompt position `end`.
    fn add_pooled(&mut self, end: usize, sum: Vec<f32>) {
        let pooled = self.pooled.as_mut().expect("an embedding session");
        // Test-only: each chunk replaces the sum of the chunks before it.
        if crate::test_defect("embed-last-chunk") {
            pooled.fill(0.0);
        }
        pooled.iter_mut().zip(sum).for_each(|(p, s)| *p += s);
        self.prompt_fed = end;
        if self.prompt_fed == self.prompt.len() {
            self.prefill_ms = self.prefill_started.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1000.0);
            self.finished = Some(FinishReason::Stop);
        }
    }

    /// An embedding request's vector once its whole prompt is in: the mean of the prompt's
    /// hidden states after the final norm, scaled to length 1 (so a dot product is the cosine
    /// similarity). `None` for a generation, or before the prompt is in.
    pub fn embedding(&self) -> Option<Vec<f32>> {
        let pooled = self.pooled.as_ref().filter(|_| self.prompt_fed == self.prompt.len())?;
        let n = self.prompt.len() as f32;
        let mean: Vec<f32> = pooled.iter().map(|s| s / n).collect();
        let norm = mean.iter().map(|v| v * v).sum::<f32>().sqrt().max(f32::MIN_POSITIVE);
        Some(mean.iter().map(|v| v / norm).collect())
    }

    /// Whether the model may pick this session's next tokens itself (greedy, no penalty).
    pub(crate) fn picks_on_device(&self) -> bool {
        self.sampler.is_plain_greedy()
    }

    /// The token a `Decode` step feeds and the cache it goes to.
    pub(crate) fn decode_input(&mut self) -> Option<(u32, &mut M::Cache)> {
        match self.work() {
            Work::Decode(token) => Some((token, &mut self.cache)),
            _ => None,
        }
    }

    /// Takes what the work just fed gave.
    pub(crate) fn fed(&mut self, next: Next) {
        match self.work() {
            Work::Prefill(range) => self.prompt_fed = range.end,
            Work::Decode(_) if self.replayed < self.resumed => self.replayed += 1,
            Work::Decode(_) => self.unfed = None,
            other => panic!("nothing was fed ({other:?})"),
        }
        if self.work() == Work::Sample {
            if self.next.is_none() && self.generated.len() == self.resumed {
                // The prompt and any checkpoint are in: the prefill ends here.
                self.prefill_ms = self.prefill_started.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1000.0);
            }
            self.next = Some(next);
        }
    }

    /// Positions in the cache now: the prompt and checkpoint tokens fed, and every sampled
    /// token but one not fed yet.
    pub fn positions(&self) -> usize {
        self.prompt_fed + self.replayed + (self.generated.len() - self.resumed) - usize::from(self.unfed.is_some())
    }

    /// Positions the cache may hold after the next batch step: its prompt chunk, or one more
    /// token (a sample fed at once).
    pub fn positions_after_step(&self) -> usize {
        match self.work() {
            Work::Prefill(range) => range.end,
            Work::Decode(_) | Work::Sample => self.positions() + 1,
            Work::Finished => self.positions(),
        }
    }

    /// Prompt tokens whose keys and values came from an earlier request's cache (not fed).
    pub fn prompt_reused(&self) -> usize {
        self.prompt_reused
    }

    /// Ends the session as cancelled.
    pub fn cancel(&mut self) {
        self.finished.get_or_insert(FinishReason::Cancelled);
    }

    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// The sampler's state now: what a checkpoint taken at this token would hold.
    pub fn sampler_state(&self) -> SamplerState {
        self.sampler.state()
    }

    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            prompt_tokens: self.prompt.clone(),
            generated_tokens: self.generated.clone(),
            delivered_text: self.text[..self.delivered].to_string(),
            sampler: self.sampler.state(),
        }
    }

    /// Samples one token, feeds it back, and returns it with the text it made final.
    /// `None` once generation has finished.
    pub fn next(&mut self, cancel: &CancelToken) -> Result<Option<(u32, String)>> {
        if self.finished.is_none() && cancel.is_cancelled() {
            self.cancel();
        }
        let sampled = self.sample()?;
        if let Work::Decode(token) = self.work() {
            // The same decode step a batch takes, with one sequence.
            let pick = self.picks_on_device();
            let next = self.model.feed_batch(&mut [(token, &mut self.cache)], &[pick]).pop().expect("one sequence fed");
            self.fed(next);
        }
        Ok(sampled)
    }

    /// Samples one token from the logits ready (when [`Self::work`] is `Sample`) and returns it
    /// with the text it made final; the token is fed by the next `Decode` step. `None` once
    /// generation has finished.
    pub fn sample(&mut self) -> Result<Option<(u32, String)>> {
        if self.finished.is_some() {
            return Ok(None);
        }
        let token = match self.next.take().expect("logits ready while not finished") {
            Next::Token(token) => token,
            Next::Logits(mut logits) => {
                let context: Vec<u32> = self.prompt.iter().chain(&self.generated).copied().collect();
                self.sampler.sample(&mut logits, &context)
            }
        };
        if !self.ignore_eos && self.bundle.eos_ids.contains(&token) {
            self.finished = Some(FinishReason::Stop);
            // Whatever was held back for a possible stop string is final now.
            let rest = self.text[self.delivered..].to_string();
            self.delivered = self.text.len();
            return Ok(Some((token, rest)));
        }
        self.generated.push(token);
        let text = self.bundle.decode(&self.generated)?;
        // A trailing U+FFFD is an incomplete UTF-8 character: wait for more bytes.
        if !text.ends_with('\u{FFFD}') {
            self.text = text;
        }
        let mut released = self.release_text();
        if self.finished.is_none() && self.generated.len() >= self.max_tokens {
            self.finished = Some(FinishReason::Length);
            released.push_str(&self.text[self.delivered..]);
            self.delivered = self.text.len();
        }
        if self.finished.is_none() {
            self.unfed = Some(token);
        }
        Ok(Some((token, released)))
    }

    /// Hands out new text, holding back a suffix that could still become a stop string.
    fn release_text(&mut self) -> String {
        if let Some((pos, _)) = self
            .stop
            .iter()
            .filter_map(|s| self.text[self.delivered..].find(s.as_str()).map(|p| (p, s)))
            .min_by_key(|(p, _)| *p)
        {
            let end = self.delivered + pos;
            let out = self.text[self.delivered..end].to_string();
            self.text.truncate(end);
            self.delivered = end;
            self.finished = Some(FinishReason::Stop);
            return out;
        }
        let pending = &self.text[self.delivered..];
        let mut hold = 0;
        for stop in &self.stop {
            for len in (1..stop.len()).rev() {
                if len <= pending.len() && stop.is_char_boundary(len) && pending.ends_with(&stop[..len]) {
                    hold = hold.max(len);
                    break;
                }
            }
        }
        let end = self.text.len() - hold;
        let out = self.text[self.delivered..end].to_string();
        self.delivered = end;
        out
    }

    /// The text delivered so far (stop strings excluded).
    pub fn text(&self) -> &str {
        &self.text[..self.delivered]
    }
}

impl<M: Decoder> Drop for Session<'_, M> {
    /// Gives the cache back to the model, which may keep its blocks for later requests.
    fn drop(&mut self) {
        // A step that panicked may have written part of a position: keep nothing of it.
        if std::thread::panicking() {
            return;
        }
        let tokens: Vec<u32> = self.prompt.iter().chain(&self.generated).copied().collect();
        self.model.retire(&mut self.cache, &tokens);
    }
}

/// Runs a whole generation, calling `on_token` for each token as it is produced.
pub fn generate<M: Decoder>(
    model: &M,
    bundle: &ModelBundle,
    request: &GenerateRequest,
    cancel: &CancelToken,
    mut on_token: impl FnMut(&StreamEvent<'_>),
) -> Result<Generation> {
    let mut session = Session::start(model, bundle, request, cancel)?;
    let started = Instant::now();
    let mut steps = 0usize;
    let already = session.generated().len();
    while let Some((token, text)) = session.next(cancel)? {
        on_token(&StreamEvent {
            token,
            index: already + steps,
            text: &text,
        });
        steps += 1;
    }
    let decode_ms = started.elapsed().as_secs_f64() * 1000.0;
    Ok(Generation {
        prompt_tokens: request.prompt_tokens.len(),
        prompt_reused: session.prompt_reused(),
        tokens: session.generated().to_vec(),
        text: session.text().to_string(),
        finish_reason: session.finished().unwrap_or(FinishReason::Length),
        prefill_ms: session.prefill_ms,
        decode_ms,
        // The first token is sampled from the prefill's logits; the rest cost a step each.
        decode_steps: steps.saturating_sub(1),
        checkpoint: session.checkpoint(),
    })
}

/// What the model predicted at each position of a fixed token sequence (teacher forcing): the
/// top token after `tokens[..=i]` and the negative log-likelihood of `tokens[i + 1]`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TeacherForced {
    pub argmax: Vec<u32>,
    pub nll: Vec<f64>,
}

impl TeacherForced {
    /// exp(mean NLL).
    pub fn perplexity(&self) -> f64 {
        (self.nll.iter().sum::<f64>() / self.nll.len().max(1) as f64).exp()
    }
}

/// Feeds `tokens` one at a time through the serving decode path (KV cache, the CPU decode
/// step where it applies) and scores every position.
pub fn teacher_forced<M: Decoder>(model: &M, config: &crate::LlamaConfig, tokens: &[u32]) -> Result<TeacherForced> {
    if tokens.len() > config.max_position_embeddings {
        return Err(Error::InvalidRequest(format!("{} tokens do not fit the context of {}", tokens.len(), config.max_position_embeddings)));
    }
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= config.vocab_size) {
        return Err(Error::InvalidRequest(format!("token id {bad} is outside the vocabulary of {}", config.vocab_size)));
    }
    let mut cache = model.new_cache(config, tokens.len().max(1));
    let mut out = TeacherForced { argmax: Vec::new(), nll: Vec::new() };
    for (i, &token) in tokens.iter().enumerate() {
        let logits = model.feed(&[token], &mut cache);
        let (best, _) = logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bv), (j, &v)| if v > bv { (j, v) } else { (bi, bv) });
        out.argmax.push(best as u32);
        if let Some(&next) = tokens.get(i + 1) {
            let max = logits[best] as f64;
            let log_sum = logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
            out.nll.push(log_sum - logits[next as usize] as f64);
        }
    }
    Ok(out)
}
