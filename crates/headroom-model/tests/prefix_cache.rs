//! The CPU engine's paged KV cache and its prefix cache: a request whose prompt begins like an
//! earlier one's starts with that one's blocks and computes, bit for bit, what it computes from
//! scratch; blocks are keyed by every token before them, not by their own alone.

use std::path::Path;

use headroom_model::cpu::{CpuModel, PrefixCache, KEY_BLOCK};
use headroom_model::fixture::{tiny_config, write_gguf_from_folder, write_random_folder};
use headroom_model::quants::GgmlType;
use headroom_model::{generate, CancelToken, GenerateRequest, LlamaConfig, ModelBundle, SamplingParams, StoreDtype};

fn config() -> LlamaConfig {
    LlamaConfig { hidden_size: 128, intermediate_size: 256, num_hidden_layers: 3, num_attention_heads: 4, num_key_value_heads: Some(2), ..tiny_config() }
}

/// A Q8_0 file: its matrices are repacked on processors with AVX-512 VNNI, whose one kernel
/// for every token count makes a prompt's keys and values independent of its chunks.
fn q8_file(dir: &Path) -> ModelBundle {
    let folder = dir.join("folder");
    write_random_folder(&folder, &config(), 23, StoreDtype::F32).unwrap();
    let file = dir.join("q8_0.gguf");
    write_gguf_from_folder(&folder, &file, GgmlType::Q8_0).unwrap();
    ModelBundle::open(&file).unwrap()
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 11 + 3) % 250).collect()
}

/// Feeds `prompt` into a cache the prefix cache fills; gives the last token's logits and how
/// many prompt tokens came from the prefix cache. The cache is retired with the prompt's
/// tokens, as a finished request's is.
fn feed(model: &CpuModel, prompt: &[u32]) -> (Vec<f32>, usize) {
    let mut cache = model.cache_for_prompt(prompt, prompt.len() + 4);
    let reused = cache.len;
    let logits = model.step(&prompt[reused..], &mut cache);
    model.retire(&mut cache, prompt);
    (logits, reused)
}

fn fresh(model: &CpuModel, prompt: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache(prompt.len());
    model.step(prompt, &mut cache)
}

/// Where prefill does not depend on chunks, prompts that share whole blocks with earlier ones
/// reuse them and get the logits a fresh cache gives, bit for bit; a prompt whose blocks match
/// another's only after a different beginning reuses nothing past the difference.
#[test]
fn a_prompt_that_begins_like_an_earlier_one_computes_what_it_computes_alone() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = q8_file(dir.path());
    let mut model = bundle.load_cpu(|_, _| {}).unwrap();
    if !model.prefill_is_chunk_invariant() {
        // No repacked kernel here (no AVX-512 VNNI): the prefix cache stays unused, so a
        // request's tokens never depend on what ran before it.
        model.prefix_cache = PrefixCache::new(64);
        let prompt = tokens(1, 40);
        feed(&model, &prompt);
        assert_eq!(feed(&model, &prompt).1, 0, "a prefix was reused where prefill depends on chunks");
        eprintln!("prefill depends on chunks on this processor: reuse is off, the exactness check did not run");
        return;
    }
    model.prefix_cache = PrefixCache::new(64);
    let block = |seed: u32| tokens(seed, KEY_BLOCK);
    let (p1, p2, s, t) = (block(1), block(2), block(3), block(4));
    let tail = tokens(5, 7);
    // A = P1 S, C = P2 T: four blocks cached.
    let a: Vec<u32> = [&p1[..], &s, &tail].concat();
    let c: Vec<u32> = [&p2[..], &t, &tail].concat();
    assert_eq!(feed(&model, &a).1, 0);
    assert_eq!(feed(&model, &c).1, 0);
    assert_eq!(model.prefix_cache.stats().blocks, 4);

    // B = P2 S ...: P2 is C's first block; S after P2 is nobody's.
    let b: Vec<u32> = [&p2[..], &s, &tokens(6, 5)].concat();
    let (logits, reused) = feed(&model, &b);
    assert_eq!(logits, fresh(&model, &b), "reused blocks changed the logits");
    assert_eq!(reused, KEY_BLOCK, "B reuses C's first block and only it");

    // A again, with a longer tail: both of its blocks.
    let a_longer: Vec<u32> = [&a[..], &tokens(7, 20)].concat();
    let (logits, reused) = feed(&model, &a_longer);
    assert_eq!(reused, 2 * KEY_BLOCK);
    assert_eq!(logits, fresh(&model, &a_longer), "reused blocks changed the logits");

    // A prompt of exactly two blocks reuses one: its last token must be fed for its logits.
    let exact: Vec<u32> = [&p1[..], &s].concat();
    let (logits, reused) = feed(&model, &exact);
    assert_eq!(reused, KEY_BLOCK);
    assert_eq!(logits, fresh(&model, &exact));

    let stats = model.prefix_cache.stats();
    assert!(stats.reused_tokens >= 4 * KEY_BLOCK as u64 && stats.hit_rate() > 0.0, "{stats:?}");
}

/// Its negative control: blocks keyed by their own tokens alone give B the S that followed P1.
#[test]
fn a_block_keyed_by_its_own_tokens_alone_changes_the_logits() {
    let dir = tempfile::tempdir().unwrap();
    if !q8_file(dir.path()).load_cpu(|_, _| {}).unwrap().prefill_is_chunk_invariant() {
        eprintln!("prefill depends on chunks on this processor: nothing is reused, so there is no control to run");
        return;
    }
    headroom_model::assert_control_fails(
        "a_prompt_that_begins_like_an_earlier_one_computes_what_it_computes_alone",
        "prefix-own-tokens",
        "reused blocks changed the logits",
    );
}

/// Through generation: a chat's second turn, sent with the first turn's prompt and answer as
/// its beginning, reuses the first turn's blocks (prompt and answer), generates what it
/// generates with the prefix cache off, and a cache too small for everything keeps its
/// capacity by dropping the least recently used blocks.
#[test]
fn a_second_turn_reuses_the_first_and_generates_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = q8_file(dir.path());
    let mut cached = bundle.load_cpu(|_, _| {}).unwrap();
    if !cached.prefill_is_chunk_invariant() {
        eprintln!("prefill depends on chunks on this processor: reuse is off (checked above)");
        return;
    }
    cached.prefix_cache = PrefixCache::new(4);
    let plain = bundle.load_cpu(|_, _| {}).unwrap();
    let run = |model: &CpuModel, prompt: &[u32]| {
        let mut request = GenerateRequest::new(prompt.to_vec(), 12, SamplingParams::default());
        request.ignore_eos = true;
        request.prefill_chunk = 8;
        generate(model, &bundle, &request, &CancelToken::new(), |_| {}).unwrap().tokens
    };
    let first = tokens(8, 30);
    let answer = run(&cached, &first);
    assert_eq!(answer, run(&plain, &first));
    // The first turn's cache held 30 + 11 tokens: two whole blocks.
    assert_eq!(cached.prefix_cache.stats().blocks, 2);
    let second: Vec<u32> = [&first[..], &answer, &tokens(9, 9)].concat();
    let before = cached.prefix_cache.stats().reused_tokens;
    assert_eq!(run(&cached, &second), run(&plain, &second), "the second turn generated other tokens with the prefix cache");
    assert_eq!(cached.prefix_cache.stats().reused_tokens - before, 2 * KEY_BLOCK as u64);
    // 42 + 9 + 11 = 62 tokens: three blocks of which the first two were shared; then other
    // prompts push the oldest out.
    for seed in 10..13 {
        run(&cached, &tokens(seed, 40));
    }
    let stats = cached.prefix_cache.stats();
    assert_eq!(stats.blocks, 4, "{stats:?}");
    assert!(stats.evicted_blocks > 0, "{stats:?}");
}

/// The model counts the KV blocks alive once each, however many caches hold them: a running
/// sequence's blocks, those the prefix cache keeps after it ends, the ones two sequences share;
/// none outlive their last holder.
#[test]
fn resident_kv_counts_each_live_block_once() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = q8_file(dir.path());
    let mut model = bundle.load_cpu(|_, _| {}).unwrap();
    let block = headroom_model::cpu::CpuCache::bytes(&bundle.config, KEY_BLOCK, model.kv_precision);
    let prompt = tokens(1, 40);
    let mut cache = model.new_cache(48);
    model.step(&prompt, &mut cache);
    assert_eq!(model.kv_resident_bytes(), 3 * block, "40 positions: three blocks");
    assert_eq!(cache.resident_bytes(), 3 * block);
    drop(cache);
    assert_eq!(model.kv_resident_bytes(), 0, "blocks outlived their cache");
    if !model.prefill_is_chunk_invariant() {
        return;
    }
    model.prefix_cache = PrefixCache::new(64);
    feed(&model, &prompt);
    assert_eq!(model.kv_resident_bytes(), 2 * block, "the prefix cache keeps the two whole blocks");
    // Two sequences reuse both and add a block each.
    let (mut a, mut b) = (model.cache_for_prompt(&prompt, 48), model.cache_for_prompt(&prompt, 48));
    model.step(&prompt[a.len..], &mut a);
    model.step(&prompt[b.len..], &mut b);
    assert_eq!(model.kv_resident_bytes(), 4 * block, "shared blocks counted once");
    drop((a, b));
    model.prefix_cache.clear();
    assert_eq!(model.kv_resident_bytes(), 0);
}

/// A cache allocated whole (`preallocate_kv`: what `headroom calibrate` measures the workspace
/// beside, since admission reserves every block) holds every block of its capacity, whether the
/// prefix cache has none of its prompt or some.
#[test]
fn a_preallocated_cache_holds_its_whole_capacity_with_or_without_a_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = q8_file(dir.path());
    let mut model = bundle.load_cpu(|_, _| {}).unwrap();
    if !model.prefill_is_chunk_invariant() {
        return; // no prefix lookup here (see above)
    }
    model.preallocate_kv = true;
    let block = headroom_model::cpu::CpuCache::bytes(&bundle.config, KEY_BLOCK, model.kv_precision);
    let (prompt, capacity) = (tokens(4, 40), 70usize);
    let whole = capacity.div_ceil(KEY_BLOCK) * block;
    assert_eq!(model.cache_for_prompt(&prompt, capacity).resident_bytes(), whole, "no prefix cache: every block at once");
    model.prefix_cache = PrefixCache::new(64);
    feed(&model, &prompt);
    let cache = model.cache_for_prompt(&prompt, capacity);
    assert_eq!(cache.len, 2 * KEY_BLOCK, "the prompt's two whole blocks came from the prefix cache");
    assert_eq!(cache.resident_bytes(), whole, "two cached blocks and the rest allocated at once");
    headroom_model::assert_control_fails("a_preallocated_cache_holds_its_whole_capacity_with_or_without_a_prefix", "prefix-drops-preallocation", "every block at once");
}
