//! The embedded demo model loads and its greedy output is stable.

use headroom_model::{generate, CancelToken, CpuBackend, GenerateRequest, ModelBundle, SamplingParams};

#[test]
fn default_model_greedy_output_is_stable() {
    let bundle = ModelBundle::open(headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL)).unwrap();
    let model = bundle.load::<CpuBackend>(&Default::default(), |_, _| {}).unwrap();
    let prompt = bundle.encode("And God said", true).unwrap();
    let request = GenerateRequest::new(prompt, 24, SamplingParams::default());
    let out = generate(&model, &bundle, &request, &CancelToken::new(), |_| {}).unwrap();
    assert_eq!(
        out.text,
        " unto him, Behold, I have done unto thee, and I will not do this thing.\nAnd the LORD said"
    );
}

#[test]
fn default_model_answers_in_chat_format_and_stops_at_im_end() {
    let bundle = ModelBundle::open(headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL)).unwrap();
    let model = bundle.load::<CpuBackend>(&Default::default(), |_, _| {}).unwrap();
    let template = bundle.template.as_ref().expect("demo model ships a chat template");
    let text = template
        .render(&[headroom_model::ChatMessage::new("user", "John 3:16")], None, true)
        .unwrap();
    assert!(text.ends_with("<|im_start|>assistant\n"));
    let prompt = bundle.encode(&text, true).unwrap();
    let request = GenerateRequest::new(prompt, 120, SamplingParams::default());
    let out = generate(&model, &bundle, &request, &CancelToken::new(), |_| {}).unwrap();
    assert_eq!(out.finish_reason, headroom_model::FinishReason::Stop, "{}", out.text);
    assert!(!out.text.contains("<|im_end|>") && out.text.split_whitespace().count() > 3, "{}", out.text);
}
