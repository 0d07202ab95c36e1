//! Loading Hugging Face folders written by the test, generation, checkpoints and errors.

use burn::tensor::{Int, Tensor, TensorData};
use headroom_model::fixture::{tiny_config, write_random_folder};
use headroom_model::weights::TensorSource;
use headroom_model::{
    generate, CancelToken, CpuBackend, Error, GenerateRequest, Llama, ModelBundle, RopeTables,
    SamplingParams, Session, StoreDtype,
};

type B = CpuBackend;

fn fixture(dtype: StoreDtype) -> (tempfile::TempDir, ModelBundle, Llama<B>) {
    let dir = tempfile::tempdir().unwrap();
    write_random_folder(dir.path(), &tiny_config(), 42, dtype).unwrap();
    let bundle = ModelBundle::open(dir.path()).unwrap();
    let model = bundle.load::<B>(&Default::default(), |_, _| {}).unwrap();
    (dir, bundle, model)
}

fn prompt(bundle: &ModelBundle) -> Vec<u32> {
    bundle.encode("In the beginning was the word", false).unwrap()
}

#[test]
fn loads_folder_with_grouped_query_attention_and_untied_head() {
    let (_dir, bundle, model) = fixture(StoreDtype::F32);
    assert_eq!(bundle.config.kv_heads(), 2);
    assert_eq!(bundle.config.num_attention_heads, 4);
    assert!(model.lm_head.is_some(), "untied embeddings load a separate lm_head");
    assert_eq!(model.layers.len(), 2);
    assert_eq!(bundle.hash.len(), 64);
    assert_eq!(bundle.eos_ids, vec![258]);
    assert!(bundle.template.is_some());
}

/// The RoPE tables for `tokens` and the logits of every position from one pass without a cache.
fn full_pass(bundle: &ModelBundle, model: &Llama<B>, tokens: &[u32]) -> (RopeTables<B>, Vec<f32>) {
    let device = Default::default();
    let rope = RopeTables::<B>::new(&bundle.config, tokens.len(), &device);
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, tokens.len()]), &device);
    let full = model.forward(input, &rope).into_data().into_vec::<f32>().unwrap();
    (rope, full)
}

#[test]
fn cached_decoding_matches_a_full_forward_pass() {
    let (_dir, bundle, model) = fixture(StoreDtype::F32);
    let tokens = prompt(&bundle);
    let n = tokens.len();
    let (rope, full) = full_pass(&bundle, &model, &tokens);
    let vocab = bundle.config.vocab_size;

    // Prefill half, then one token at a time: every position's logits must agree.
    let mut cache = headroom_model::KvCache::new(&bundle.config, n);
    let half = n / 2;
    let mut got = model.step(&tokens[..half], &rope, &mut cache);
    let mut pos = half - 1;
    loop {
        let expected = &full[pos * vocab..(pos + 1) * vocab];
        let max_diff = expected
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(max_diff < 1e-4, "position {pos}: logits differ by {max_diff}");
        pos += 1;
        if pos == n {
            break;
        }
        got = model.step(&tokens[pos..pos + 1], &rope, &mut cache);
    }
}

#[test]
fn greedy_generation_is_deterministic() {
    let (_dir, bundle, model) = fixture(StoreDtype::F32);
    let request = GenerateRequest::new(prompt(&bundle), 16, SamplingParams::default());
    let cancel = CancelToken::new();
    let a = generate(&model, &bundle, &request, &cancel, |_| {}).unwrap();
    let b = generate(&model, &bundle, &request, &cancel, |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert!(!a.tokens.is_empty());
}

#[test]
fn streamed_text_adds_up_to_the_final_text() {
    let (_dir, bundle, model) = fixture(StoreDtype::F32);
    let params = SamplingParams {
        temperature: 0.8,
        seed: 5,
        ..Default::default()
    };
    let request = GenerateRequest::new(prompt(&bundle), 24, params);
    let mut streamed = String::new();
    let result = generate(&model, &bundle, &request, &CancelToken::new(), |e| {
        streamed.push_str(e.text)
    })
    .unwrap();
    assert_eq!(streamed, result.text);
}

#[test]
fn resuming_from_a_checkpoint_reproduces_the_straight_run() {
    let (_dir, bundle, model) = fixture(StoreDtype::F32);
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 40,
        top_p: 0.95,
        repetition_penalty: 1.1,
        seed: 1234,
    };
    let request = GenerateRequest::new(prompt(&bundle), 24, params);
    let cancel = CancelToken::new();
    let straight = generate(&model, &bundle, &request, &cancel, |_| {}).unwrap();
    assert_eq!(straight.tokens.len(), 24, "random fixture never emits EOS early here");

    let mut session = Session::start(&model, &bundle, &request, &cancel).unwrap();
    let mut first_part = String::new();
    for _ in 0..9 {
        let (_, text) = session.next(&cancel).unwrap().unwrap();
        first_part.push_str(&text);
    }
    let checkpoint = session.checkpoint();
    assert_eq!(checkpoint.generated_tokens, straight.tokens[..9]);
    drop(session);
    // Through JSON, as a checkpoint travels between processes.
    let checkpoint = serde_json::from_str(&serde_json::to_string(&checkpoint).unwrap()).unwrap();

    let mut resumed_request = request.clone();
    resumed_request.resume = Some(checkpoint);
    let mut rest = String::new();
    let resumed = generate(&model, &bundle, &resumed_request, &cancel, |e| rest.push_str(e.text)).unwrap();
    assert_eq!(resumed.tokens, straight.tokens);
    assert_eq!(format!("{first_part}{rest}"), straight.text);
}

#[test]
fn stop_string_ends_generation_before_it() {
    let (_dir, bundle, model) = fixture(StoreDtype::F32);
    let request = GenerateRequest::new(prompt(&bundle), 30, SamplingParams::default());
    let cancel = CancelToken::new();
    let straight = generate(&model, &bundle, &request, &cancel, |_| {}).unwrap();
    let chars: Vec<char> = straight.text.chars().collect();
    assert!(chars.len() > 12);
    let stop: String = chars[8..11].iter().collect();
    let mut with_stop = request.clone();
    with_stop.stop = vec![stop.clone()];
    let mut streamed = String::new();
    let stopped = generate(&model, &bundle, &with_stop, &cancel, |e| streamed.push_str(e.text)).unwrap();
    let expected = &straight.text[..straight.text.find(&stop).unwrap()];
    assert_eq!(stopped.text, expected);
    assert_eq!(streamed, expected, "held-back text never leaks part of the stop string");
    assert_eq!(stopped.finish_reason, headroom_model::FinishReason::Stop);
}

#[test]
fn cancellation_stops_at_the_next_step() {
    let (_dir, bundle, model) = fixture(StoreDtype::F32);
    let request = GenerateRequest::new(prompt(&bundle), 50, SamplingParams::default());
    let cancel = CancelToken::new();
    let mut seen = 0;
    let result = generate(&model, &bundle, &request, &cancel, |_| {
        seen += 1;
        if seen == 3 {
            cancel.cancel();
        }
    })
    .unwrap();
    assert_eq!(result.finish_reason, headroom_model::FinishReason::Cancelled);
    assert_eq!(result.tokens.len(), 3);
}

#[test]
fn half_precision_weights_load_as_f32() {
    let (_d1, bundle, f32_model) = fixture(StoreDtype::F32);
    let (_d2, _, bf16_model) = fixture(StoreDtype::BF16);
    let tokens = prompt(&bundle);
    let device = Default::default();
    let rope = RopeTables::<B>::new(&bundle.config, tokens.len(), &device);
    let logits = |m: &Llama<B>| {
        let mut cache = headroom_model::KvCache::new(&bundle.config, tokens.len());
        m.step(&tokens, &rope, &mut cache)
    };
    let (a, b) = (logits(&f32_model), logits(&bf16_model));
    let max_diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(max_diff < 0.05, "bf16 weights drift by {max_diff}");
}

#[test]
fn too_long_prompt_is_an_error_that_names_the_limits() {
    let (_dir, bundle, model) = fixture(StoreDtype::F32);
    let tokens: Vec<u32> = (0..120).map(|i| (i % 200) as u32).collect();
    let request = GenerateRequest::new(tokens, 20, SamplingParams::default());
    let err = generate(&model, &bundle, &request, &CancelToken::new(), |_| {}).unwrap_err();
    assert!(matches!(err, Error::ContextOverflow { available: 8, .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("120 tokens") && message.contains("128 tokens") && message.contains("at most 8"), "{message}");
}

#[test]
fn missing_weights_are_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    write_random_folder(dir.path(), &tiny_config(), 1, StoreDtype::F32).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let message = ModelBundle::open(dir.path()).unwrap_err().to_string();
    assert!(message.contains("no model.safetensors"), "{message}");
}

#[test]
fn corrupt_weights_are_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    write_random_folder(dir.path(), &tiny_config(), 1, StoreDtype::F32).unwrap();
    let path = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&path, bytes).unwrap();
    let message = ModelBundle::open(dir.path()).unwrap_err().to_string();
    assert!(message.contains("model.safetensors is not a valid safetensors file"), "{message}");
}

#[test]
fn weights_that_do_not_match_the_config_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = tiny_config();
    write_random_folder(dir.path(), &config, 1, StoreDtype::F32).unwrap();
    config.intermediate_size = 96;
    std::fs::write(dir.path().join("config.json"), serde_json::to_string(&config).unwrap()).unwrap();
    let bundle = ModelBundle::open(dir.path()).unwrap();
    let message = bundle.load::<B>(&Default::default(), |_, _| {}).unwrap_err().to_string();
    assert!(message.contains("mlp.gate_proj.weight") && message.contains("[128, 64]"), "{message}");
}

#[test]
fn sharded_weights_load_through_the_index() {
    let (dir, bundle, model) = fixture(StoreDtype::F32);
    // Re-export the same tensors as two shards plus an index.
    let files = headroom_model::weights::WeightFiles::open(dir.path()).unwrap();
    let names: Vec<String> = {
        let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
        let st = safetensors_names(&bytes);
        st
    };
    let (a, b) = names.split_at(names.len() / 2);
    let shard = |names: &[String], file: &str| {
        let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = names
            .iter()
            .map(|n| {
                let (v, s) = files.read_f32(n).unwrap();
                (n.clone(), s, v)
            })
            .collect();
        headroom_model::weights::write_safetensors(&tensors, &dir.path().join(file), StoreDtype::F32).unwrap();
    };
    shard(a, "model-00001-of-00002.safetensors");
    shard(b, "model-00002-of-00002.safetensors");
    drop(files);
    let mut map = serde_json::Map::new();
    for n in a {
        map.insert(n.clone(), "model-00001-of-00002.safetensors".into());
    }
    for n in b {
        map.insert(n.clone(), "model-00002-of-00002.safetensors".into());
    }
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({ "weight_map": map }).to_string(),
    )
    .unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let sharded = ModelBundle::open(dir.path()).unwrap();
    let sharded_model = sharded.load::<B>(&Default::default(), |_, _| {}).unwrap();
    let request = GenerateRequest::new(prompt(&bundle), 8, SamplingParams::default());
    let cancel = CancelToken::new();
    let x = generate(&model, &bundle, &request, &cancel, |_| {}).unwrap();
    let y = generate(&sharded_model, &sharded, &request, &cancel, |_| {}).unwrap();
    assert_eq!(x.tokens, y.tokens);
}

fn safetensors_names(bytes: &[u8]) -> Vec<String> {
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect()
}

#[test]
fn scripted_folder_answers_its_script_for_any_chat_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let pieces = ["<tool_call>", r#"{"name":"append","arguments":{"entry":"x"}}"#, "</tool_call>"];
    headroom_model::fixture::write_scripted_folder(dir.path(), &pieces).unwrap();
    let bundle = ModelBundle::open(dir.path()).unwrap();
    let model = bundle.load::<B>(&Default::default(), |_, _| {}).unwrap();
    for question in ["Record a payment", "Something else entirely, with more words"] {
        let prompt = bundle
            .chat_prompt(&[headroom_model::ChatMessage::new("user", question)], None)
            .unwrap();
        let request = GenerateRequest::new(prompt, 32, SamplingParams::default());
        let out = generate(&model, &bundle, &request, &CancelToken::new(), |_| {}).unwrap();
        assert_eq!(out.text, pieces.concat());
        assert_eq!(out.finish_reason, headroom_model::FinishReason::Stop);
    }
}

/// The matrices and embedding of the burn model (the CUDA path) load in the type asked for —
/// f16 or bf16 on a GPU — while norms and activations stay f32, and the model's logits are the
/// f32 model's. ndarray has no 16-bit floats, so f64 matrices stand in for them here: the casts
/// around every product, the embedding and the tied and untied heads run the same way.
#[test]
fn matrices_load_in_the_type_asked_for_and_give_the_f32_logits() {
    use burn::tensor::DType;
    for tied in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let config = headroom_model::LlamaConfig { tie_word_embeddings: tied, ..tiny_config() };
        write_random_folder(dir.path(), &config, 42, StoreDtype::F32).unwrap();
        let bundle = ModelBundle::open(dir.path()).unwrap();
        let device = Default::default();
        let reference = bundle.load::<B>(&device, |_, _| {}).unwrap();
        let wide = bundle.load_as::<B>(&device, DType::F64, |_, _| {}).unwrap();
        let layer = &wide.layers[0];
        let mut matrices = vec![wide.embed_tokens.weight.val().dtype(), layer.self_attn.q_proj.weight.val().dtype(), layer.mlp.down_proj.weight.val().dtype()];
        matrices.extend(wide.lm_head.as_ref().map(|h| h.weight.val().dtype()));
        assert!(matrices.iter().all(|&d| d == DType::F64), "tied {tied}: matrices loaded as {matrices:?}, not the F64 asked for");
        assert_eq!(layer.input_layernorm.weight.val().dtype(), DType::F32, "norms stay f32");
        // What admission counts for a GPU's weights is what the loaded model holds.
        let bytes = |t: burn::tensor::Tensor<B, 2>| (t.shape().num_elements() * t.dtype().size()) as u64;
        let norm_bytes = |n: &headroom_model::model::RmsNorm<B>| (n.weight.val().shape().num_elements() * 4) as u64;
        let mut held = bytes(wide.embed_tokens.weight.val()) + norm_bytes(&wide.norm);
        held += wide.lm_head.as_ref().map_or(0, |h| bytes(h.weight.val()));
        for l in &wide.layers {
            let a = &l.self_attn;
            for linear in [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj] {
                held += bytes(linear.weight.val());
            }
            held += norm_bytes(&l.input_layernorm) + norm_bytes(&l.post_attention_layernorm);
        }
        assert_eq!(bundle.weight_bytes_as(DType::F64), held, "tied {tied}: predicted weight bytes");

        let tokens = prompt(&bundle);
        let rope = RopeTables::<B>::new(&bundle.config, tokens.len() + 1, &device);
        let logits = |m: &Llama<B>| {
            let mut cache = headroom_model::KvCache::new(&bundle.config, tokens.len() + 1);
            let mut out = m.step(&tokens, &rope, &mut cache);
            out.extend(m.step(&[7], &rope, &mut cache));
            out
        };
        let (want, got) = (logits(&reference), logits(&wide));
        let max_diff = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(max_diff < 1e-3, "tied {tied}: logits with f64 matrices differ from f32 by {max_diff}");
    }
}

/// Its negative control: with the requested type ignored (matrices loaded as f32, as before
/// GPUs got 16-bit weights) the check fails.
#[test]
fn the_matrix_type_check_fails_when_the_type_is_ignored() {
    headroom_model::assert_control_fails("matrices_load_in_the_type_asked_for_and_give_the_f32_logits", "matrices-f32", "not the F64 asked for");
}

/// burn's cache in blocks: a sequence fed in uneven chunks across several block boundaries (and
/// two growths of the cache) gets, at every position, the logits of one full pass without a
/// cache, and holds at most twice the blocks its positions fill.
#[test]
fn a_cache_in_blocks_gives_the_logits_of_a_full_pass() {
    let (_dir, bundle, model) = fixture(StoreDtype::F32);
    let tokens: Vec<u32> = (0..53).map(|i| (i * 37 % 250) as u32).collect();
    let n = tokens.len();
    let (rope, full) = full_pass(&bundle, &model, &tokens);
    let vocab = bundle.config.vocab_size;
    let block = headroom_model::model::KV_BLOCK;

    let mut cache = headroom_model::KvCache::new(&bundle.config, n);
    assert_eq!(cache.resident_bytes(), 0, "nothing is held before a position is written");
    // Chunks of 5, 20 and 1: one starts and ends inside blocks, one spans a whole block.
    let mut fed = 0;
    for chunk in [5, 20].into_iter().chain(std::iter::repeat(1)) {
        if fed == n {
            break;
        }
        let end = (fed + chunk).min(n);
        let got = model.step(&tokens[fed..end], &rope, &mut cache);
        let pos = end - 1;
        let expected = &full[pos * vocab..(pos + 1) * vocab];
        let max_diff = expected.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        // A prompt chunk's products add in another order than the full pass's: rounding only.
        assert!(max_diff < 1e-3, "position {pos}: the cache in blocks changes the logits by {max_diff}");
        let needed = end.div_ceil(block);
        assert!(cache.blocks() >= needed && cache.blocks() <= (2 * needed).min(n.div_ceil(block)).max(needed), "{} blocks after {end} positions", cache.blocks());
        fed = end;
    }
    let whole = headroom_model::KvCache::<B>::bytes(&bundle.config, n.next_multiple_of(block));
    assert_eq!(cache.resident_bytes(), whole, "the blocks of {n} positions");
}

#[test]
fn the_cache_test_fails_when_growing_drops_what_was_written() {
    headroom_model::assert_control_fails("a_cache_in_blocks_gives_the_logits_of_a_full_pass", "kv-grow-drops-old", "the cache in blocks changes the logits");
}
