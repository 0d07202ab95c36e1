//! Continuous batching: the running sessions of one model advance together, one step at a time.
//!
//! A step samples the next token of every session whose logits are ready, then feeds every
//! session's pending token in one batched decode ([`Decoder::feed_batch`]: the weights are read
//! once for all of them), then feeds at most one prompt chunk of a joining session. Sessions
//! join and leave between steps; each keeps its own KV cache, sampler, stop rules and cancel
//! token, so a session's tokens are the ones it would produce alone (the decode rows of a batch
//! give each sequence exactly its lone logits, and a prompt is fed in the same chunks either
//! way). A long prompt delays the running streams by one chunk per step, never by its whole
//! prefill.

use crate::generate::{CancelToken, Decoder, Session, Work};
use crate::Result;

/// A session that left the batch: finished (see [`Session::finished`]), stopped by the caller's
/// answer to a token, or failed with an error.
pub struct Left<'m, M: Decoder, K> {
    pub key: K,
    pub session: Session<'m, M>,
    pub error: Option<crate::Error>,
}

struct Entry<'m, M: Decoder, K> {
    key: K,
    session: Session<'m, M>,
    cancel: CancelToken,
    stopped: bool,
    error: Option<crate::Error>,
}

/// The sessions a worker runs together on one model.
pub struct Batch<'m, M: Decoder, K> {
    model: &'m M,
    entries: Vec<Entry<'m, M, K>>,
}

impl<'m, M: Decoder, K> Batch<'m, M, K> {
    pub fn new(model: &'m M) -> Self {
        Self { model, entries: Vec::new() }
    }

    /// Adds a session made by [`Session::new`] (it prefills in the coming steps).
    pub fn join(&mut self, key: K, session: Session<'m, M>, cancel: CancelToken) {
        self.entries.push(Entry { key, session, cancel, stopped: false, error: None });
    }

    /// The sessions in the order they joined (the newest last).
    pub fn sessions(&self) -> impl Iterator<Item = (&K, &Session<'m, M>)> {
        self.entries.iter().map(|e| (&e.key, &e.session))
    }

    /// Takes the session of `key` out of the batch (a preemption), between steps.
    pub fn remove(&mut self, key: &K) -> Option<Session<'m, M>>
    where
        K: PartialEq,
    {
        let at = self.entries.iter().position(|e| &e.key == key)?;
        Some(self.entries.remove(at).session)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// One step (see the module's description); returns the sessions that left the batch.
    /// `on_token(key, session, token, text)` hears each token sampled with the text it made
    /// final; its answer decides whether the session goes on (`true`) or leaves the batch now
    /// (`false`, e.g. an injected fault), handed back unfinished.
    pub fn step(&mut self, mut on_token: impl FnMut(&K, &Session<'m, M>, u32, String) -> bool) -> Vec<Left<'m, M, K>> {
        for entry in &mut self.entries {
            if entry.cancel.is_cancelled() {
                entry.session.cancel();
            }
        }
        for entry in &mut self.entries {
            if entry.session.work() != Work::Sample {
                continue;
            }
            match entry.session.sample() {
                Ok(Some((token, text))) => {
                    entry.stopped = !on_token(&entry.key, &entry.session, token, text);
                }
                Ok(None) => {}
                Err(e) => entry.error = Some(e),
            }
        }
        let mut decoding: Vec<(u32, &mut M::Cache)> = Vec::new();
        let mut pick = Vec::new();
        let mut fed = Vec::new();
        for (i, entry) in self.entries.iter_mut().enumerate() {
            if entry.stopped || entry.error.is_some() {
                continue;
            }
            let picks = entry.session.picks_on_device();
            if let Some(input) = entry.session.decode_input() {
                decoding.push(input);
                pick.push(picks);
                fed.push(i);
            }
        }
        if !decoding.is_empty() {
            let next = self.model.feed_batch(&mut decoding, &pick);
            drop(decoding);
            for (i, next) in fed.into_iter().zip(next) {
                self.entries[i].session.fed(next);
            }
        }
        // An encoder pools every waiting prompt in one pass; otherwise one prompt chunk per
        // step, first come first served.
        if self.model.pools_prompts_together() {
            let mut prompts = Vec::new();
            let mut fed = Vec::new();
            for (i, entry) in self.entries.iter_mut().enumerate() {
                if entry.stopped || entry.error.is_some() {
                    continue;
                }
                if let Some(input) = entry.session.pooled_input() {
                    prompts.push(input);
                    fed.push(i);
                }
            }
            if !prompts.is_empty() {
                let sums = self.model.feed_pooled_many(&mut prompts);
                drop(prompts);
                for (i, sum) in fed.into_iter().zip(sums) {
                    self.entries[i].session.pooled_fed(sum);
                }
            }
        } else if let Some(entry) = self
            .entries
            .iter_mut()
            .find(|e| !e.stopped && e.error.is_none() && matches!(e.session.work(), Work::Prefill(_)))
        {
            entry.session.feed_prefill();
        }
        let mut left = Vec::new();
        let mut i = 0;
        while i < self.entries.len() {
            let e = &self.entries[i];
            if e.stopped || e.error.is_some() || e.session.work() == Work::Finished {
                let e = self.entries.remove(i);
                left.push(Left { key: e.key, session: e.session, error: e.error });
            } else {
                i += 1;
            }
        }
        left
    }
}

/// Runs requests to the end together (greedy or sampled, each its own), returning each one's
/// tokens in the order given: what a worker's batch produces, without the worker.
pub fn generate_together<M: Decoder>(
    model: &M,
    bundle: &crate::ModelBundle,
    requests: &[crate::GenerateRequest],
) -> Result<Vec<Vec<u32>>> {
    let mut batch = Batch::new(model);
    for (i, request) in requests.iter().enumerate() {
        batch.join(i, Session::new(model, bundle, request)?, CancelToken::new());
    }
    let mut tokens = vec![Vec::new(); requests.len()];
    while !batch.is_empty() {
        for left in batch.step(|_, _, _, _| true) {
            if let Some(e) = left.error {
                return Err(e);
            }
            tokens[left.key] = left.session.generated().to_vec();
        }
    }
    Ok(tokens)
}

/// Aggregate decode tokens/s of `n` sequences decoded together through a batch (a benchmark):
/// every sequence prefills `request`'s prompt (rotated by its index, so no two are alike) and
/// then decodes its `max_tokens`; the clock starts once every sequence has its first token, so it
/// times batched decode steps only.
pub fn decode_throughput<M: Decoder>(model: &M, bundle: &crate::ModelBundle, request: &crate::GenerateRequest, n: usize) -> Result<f64> {
    let mut batch = Batch::new(model);
    for i in 0..n {
        let mut r = request.clone();
        let len = r.prompt_tokens.len();
        r.prompt_tokens.rotate_left(i % len.max(1));
        batch.join(i, Session::new(model, bundle, &r)?, CancelToken::new());
    }
    let mut started = vec![false; n];
    while !started.iter().all(|&s| s) && !batch.is_empty() {
        batch.step(|&i, _, _, _| {
            started[i] = true;
            true
        });
    }
    let clock = std::time::Instant::now();
    let mut tokens = 0usize;
    while !batch.is_empty() {
        batch.step(|_, _, _, _| {
            tokens += 1;
            true
        });
    }
    Ok(tokens as f64 / clock.elapsed().as_secs_f64().max(1e-9))
}
