//! Blocks of KV cache that earlier sequences computed, kept for requests that begin the same
//! way: the same system prompt, or the earlier turns of the same chat sent again with a new
//! message. Such a request starts with those blocks in its table (shared, read-only) and feeds
//! only the rest of its prompt.
//!
//! A block is keyed by a hash chained over every token up to its end, since a position's keys
//! and values depend on all the tokens before it; each entry also keeps its own tokens and its
//! parent's key, checked on lookup. The cache holds at most `capacity` blocks; past that the
//! least recently used go first. A block a running sequence also holds stays alive in that
//! sequence until it ends.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use super::attention::{KvBlock, KEY_BLOCK};

/// What the cache holds and has done, for status and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrefixStats {
    /// Blocks held now, and their bytes (some may be shared with running sequences).
    pub blocks: u64,
    pub bytes: u64,
    /// Blocks it may hold.
    pub capacity_blocks: u64,
    /// Prompt tokens looked up in whole blocks, and those found: the hit rate is their ratio.
    pub looked_up_tokens: u64,
    pub reused_tokens: u64,
    /// Blocks dropped to make room.
    pub evicted_blocks: u64,
}

impl PrefixStats {
    /// Share of looked-up prompt tokens that were found, 0 before any lookup.
    pub fn hit_rate(&self) -> f64 {
        if self.looked_up_tokens == 0 { 0.0 } else { self.reused_tokens as f64 / self.looked_up_tokens as f64 }
    }
}

#[derive(Default)]
pub struct PrefixCache {
    entries: Mutex<Entries>,
}

#[derive(Default)]
struct Entries {
    by_key: HashMap<u64, Entry>,
    /// Advances at every use; an entry's `used` says when it was used last.
    clock: u64,
    stats: PrefixStats,
}

struct Entry {
    parent: u64,
    tokens: [u32; KEY_BLOCK],
    block: Arc<KvBlock>,
    used: u64,
    /// Blocks before it in its chain: of two used at once, the deeper goes first, so no
    /// entry outlives the parent it is reached through.
    depth: usize,
}

/// Whether the entry's block comes after the blocks keyed `parent`.
fn follows(entry: &Entry, parent: u64) -> bool {
    // Test-only: see `key`.
    entry.parent == parent || crate::test_defect("prefix-own-tokens")
}

/// The key of the block holding `tokens` after the blocks keyed `parent` (0: the first).
fn key(parent: u64, tokens: &[u32]) -> u64 {
    // Test-only: key a block by its own tokens alone, as if its keys and values did not
    // depend on the tokens before it.
    let parent = if crate::test_defect("prefix-own-tokens") { 0 } else { parent };
    // SipHash with fixed keys: the same key in every process and run.
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish() | 1
}

impl PrefixCache {
    /// A cache of at most `capacity_blocks` blocks (0: off).
    pub fn new(capacity_blocks: usize) -> Self {
        let cache = Self::default();
        cache.entries.lock().unwrap().stats.capacity_blocks = capacity_blocks as u64;
        cache
    }

    /// The cached blocks that begin `prompt`, in order: as many whole blocks as agree, leaving
    /// at least its last token out (the request needs that token's logits).
    pub fn lookup(&self, prompt: &[u32]) -> Vec<Arc<KvBlock>> {
        let mut entries = self.entries.lock().unwrap();
        if entries.stats.capacity_blocks == 0 {
            return Vec::new();
        }
        let whole = prompt.len().saturating_sub(1) / KEY_BLOCK;
        entries.stats.looked_up_tokens += (whole * KEY_BLOCK) as u64;
        entries.clock += 1;
        let now = entries.clock;
        let mut found = Vec::new();
        let mut parent = 0;
        for tokens in prompt.chunks_exact(KEY_BLOCK).take(whole) {
            let k = key(parent, tokens);
            match entries.by_key.get_mut(&k) {
                Some(e) if follows(e, parent) && e.tokens == tokens => {
                    e.used = now;
                    found.push(e.block.clone());
                }
                _ => break,
            }
            parent = k;
        }
        entries.stats.reused_tokens += (found.len() * KEY_BLOCK) as u64;
        found
    }

    /// Keeps the whole blocks of a finished sequence: `blocks[i]` holds positions
    /// `16i..16i + 16` of `tokens`, the tokens its cache holds.
    pub fn insert(&self, tokens: &[u32], blocks: &[Arc<KvBlock>]) {
        let mut entries = self.entries.lock().unwrap();
        let capacity = entries.stats.capacity_blocks as usize;
        if capacity == 0 {
            return;
        }
        entries.clock += 1;
        let now = entries.clock;
        let mut parent = 0;
        for (depth, (tokens, block)) in tokens.chunks_exact(KEY_BLOCK).zip(blocks).enumerate() {
            let k = key(parent, tokens);
            let entry = entries.by_key.entry(k).or_insert_with(|| Entry {
                parent,
                tokens: tokens.try_into().expect("a whole block"),
                block: block.clone(),
                used: now,
                depth,
            });
            entry.used = now;
            parent = k;
        }
        while entries.by_key.len() > capacity {
            let oldest = entries.by_key.iter().min_by_key(|(_, e)| (e.used, std::cmp::Reverse(e.depth))).map(|(k, _)| *k).expect("not empty");
            entries.by_key.remove(&oldest);
            entries.stats.evicted_blocks += 1;
        }
    }

    pub fn stats(&self) -> PrefixStats {
        let entries = self.entries.lock().unwrap();
        let mut stats = entries.stats;
        stats.blocks = entries.by_key.len() as u64;
        stats.bytes = entries.by_key.values().map(|e| e.block.bytes() as u64).sum();
        stats
    }

    /// Drops every block (the capacity stays).
    pub fn clear(&self) {
        self.entries.lock().unwrap().by_key.clear();
    }
}
