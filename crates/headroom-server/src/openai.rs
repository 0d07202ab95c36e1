//! OpenAI's request and response shapes, their validation, and their translation into router
//! submissions. Unknown fields are ignored (clients send many); fields we cannot honour are
//! refused with a 400 that says so, never silently dropped.

use headroom_model::{ChatMessage, GenerateRequest, ModelBundle, PromptInput, PromptSource, SamplingParams};
use headroom_router::{Completion, RunOutcome};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct MessageIn {
    /// system, developer, user, assistant or tool.
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
}

/// Headroom's own request options (all optional).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct HeadroomOptions {
    /// A stream interrupted by a GPU failure continues on the CPU from its last token (default true).
    pub allow_resume: Option<bool>,
    /// Admission may lower max_tokens to fit the GPU instead of moving the request (default false).
    pub allow_shrink: Option<bool>,
    /// The request may run on the CPU worker when the GPU cannot take it (default true).
    pub allow_cpu: Option<bool>,
    /// How long the client waits, in ms: a request expected to take longer is refused now.
    pub timeout_ms: Option<u64>,
}

/// Fields both endpoints share.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CommonParams {
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    /// 0 to 2; 0 is greedy. Default 1.
    pub temperature: Option<f32>,
    /// (0, 1]. Default 1.
    pub top_p: Option<f32>,
    /// Headroom extension: keep only the k most likely tokens (0 = off).
    pub top_k: Option<u32>,
    /// Headroom extension: > 1 discourages repeating tokens.
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    pub n: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logprobs: Option<bool>,
    /// vLLM's extension: generate max_tokens even past the end-of-sequence token.
    pub ignore_eos: Option<bool>,
    pub headroom: Option<HeadroomOptions>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    /// The served model's id (GET /v1/models), or `default`.
    #[schema(example = "default")]
    pub model: String,
    pub messages: Vec<MessageIn>,
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<serde_json::Value>,
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<serde_json::Value>,
    #[serde(flatten)]
    pub params: CommonParams,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptIn {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    #[schema(example = "default")]
    pub model: String,
    pub prompt: PromptIn,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub params: CommonParams,
}

/// A validated request, ready for the router.
pub struct Prepared {
    pub request: GenerateRequest,
    pub stream: bool,
    pub include_usage: bool,
    pub allow_resume: bool,
    pub allow_shrink: bool,
    pub allow_cpu: bool,
    pub timeout_ms: Option<u64>,
    pub tools: bool,
}

/// Limits the server applies to every request.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The served model's context (prompt + max_tokens), after any worker cap.
    pub context_tokens: usize,
    /// max_tokens when the client sends none.
    pub default_max_tokens: usize,
}

const MAX_STOP_SEQUENCES: usize = 4;

fn prepare(limits: &Limits, prompt_tokens: Vec<u32>, p: &CommonParams, tools: bool) -> Result<Prepared, ApiError> {
    if let Some(n) = p.n {
        if n != 1 {
            return Err(ApiError::invalid("n", format!("n = {n}: Headroom generates one choice per request; send n = 1 (or leave it out) and make several requests")));
        }
    }
    for (name, value) in [("presence_penalty", p.presence_penalty), ("frequency_penalty", p.frequency_penalty)] {
        if value.is_some_and(|v| v != 0.0) {
            return Err(ApiError::invalid(name, format!("{name} is not supported; use repetition_penalty (> 1 discourages repeats) instead")));
        }
    }
    if p.logprobs == Some(true) {
        return Err(ApiError::invalid("logprobs", "logprobs are not supported yet; leave logprobs out or false"));
    }
    let temperature = p.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid("temperature", format!("temperature {temperature} is out of range: use 0 (greedy) to 2")));
    }
    let top_p = p.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p", format!("top_p {top_p} is out of range: use a value in (0, 1]")));
    }
    let repetition_penalty = p.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty <= 10.0) {
        return Err(ApiError::invalid("repetition_penalty", format!("repetition_penalty {repetition_penalty} is out of range: use (0, 10]; 1 is off")));
    }
    let stop = match &p.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOP_SEQUENCES {
        return Err(ApiError::invalid("stop", format!("{} stop sequences: at most {MAX_STOP_SEQUENCES}", stop.len())));
    }
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid("stop", "a stop sequence is empty; remove it"));
    }
    if prompt_tokens.is_empty() {
        return Err(ApiError::invalid("messages", "the prompt is empty after tokenization; send some text"));
    }
    let context = limits.context_tokens;
    let prompt_len = prompt_tokens.len();
    if prompt_len >= context {
        return Err(ApiError::invalid(
            "messages",
            format!("the prompt is {prompt_len} tokens, but this model's context is {context} tokens (prompt + max_tokens); shorten it"),
        ));
    }
    let room = context - prompt_len;
    let max_tokens = match p.max_completion_tokens.or(p.max_tokens) {
        Some(0) => return Err(ApiError::invalid("max_tokens", "max_tokens must be at least 1")),
        Some(m) if m as usize > room => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!("max_tokens {m} does not fit: the prompt is {prompt_len} tokens and the context {context}, so at most {room} new tokens; lower max_tokens or shorten the prompt"),
            ))
        }
        Some(m) => m as usize,
        None => limits.default_max_tokens.min(room),
    };
    let sampling = SamplingParams {
        temperature,
        top_k: p.top_k.unwrap_or(0) as usize,
        top_p,
        repetition_penalty,
        // A request without a seed still gets one, recorded in the journal, so a replay after a
        // failure reproduces what the first attempt would have said.
        seed: p.seed.unwrap_or_else(rand::random),
    };
    sampling.validate().map_err(|e| ApiError::invalid(None, e.to_string()))?;
    let mut request = GenerateRequest::new(prompt_tokens, max_tokens, sampling);
    request.stop = stop;
    request.ignore_eos = p.ignore_eos.unwrap_or(false);
    let options = p.headroom.clone().unwrap_or_default();
    Ok(Prepared {
        request,
        stream: p.stream.unwrap_or(false),
        include_usage: p.stream_options.as_ref().is_some_and(|o| o.include_usage),
        allow_resume: options.allow_resume.unwrap_or(true),
        allow_shrink: options.allow_shrink.unwrap_or(false),
        allow_cpu: options.allow_cpu.unwrap_or(true),
        timeout_ms: options.timeout_ms,
        tools,
    })
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

pub fn prepare_chat(bundle: &ModelBundle, limits: &Limits, body: &ChatCompletionRequest) -> Result<Prepared, ApiError> {
    if body.messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages is empty: send at least one message"));
    }
    let mut messages = Vec::with_capacity(body.messages.len());
    for (i, m) in body.messages.iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::invalid("messages", format!("messages[{i}].role {:?} is not one of {}", m.role, ROLES.join(", "))));
        }
        let content = match &m.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                "messages",
                                format!("messages[{i}].content[{j}] is of type {kind:?}: this model reads text parts only"),
                            ))
                        }
                    }
                }
                text
            }
        };
        if content.is_empty() && m.tool_calls.is_none() {
            return Err(ApiError::invalid("messages", format!("messages[{i}] has no content")));
        }
        messages.push(ChatMessage { role: m.role.clone(), content, tool_calls: m.tool_calls.clone(), tool_call_id: m.tool_call_id.clone(), name: m.name.clone() });
    }
    let tools = match &body.tools {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::Array(list)) => {
            for (i, t) in list.iter().enumerate() {
                if t["type"] != "function" || !t["function"]["name"].is_string() {
                    return Err(ApiError::invalid("tools", format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}")));
                }
            }
            (!list.is_empty()).then(|| body.tools.clone().unwrap())
        }
        Some(_) => return Err(ApiError::invalid("tools", "tools must be an array of function tools")),
    };
    let prompt = bundle.chat_prompt(&messages, tools.as_ref()).map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let has_tools = tools.is_some();
    let mut prepared = prepare(limits, prompt, &body.params, has_tools)?;
    prepared.request.source = Some(PromptSource { bundle_hash: bundle.hash.clone(), input: PromptInput::Chat { messages, tools } });
    Ok(prepared)
}

pub fn prepare_completion(bundle: &ModelBundle, limits: &Limits, body: &CompletionRequest) -> Result<Prepared, ApiError> {
    if body.echo == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not supported; leave it out or false"));
    }
    if body.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix (fill-in-the-middle) is not supported"));
    }
    let prompt = match &body.prompt {
        PromptIn::One(p) => p.clone(),
        PromptIn::Many(list) if list.len() == 1 => list[0].clone(),
        PromptIn::Many(list) => {
            return Err(ApiError::invalid("prompt", format!("{} prompts: send one prompt per request", list.len())));
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "prompt is empty"));
    }
    let tokens = bundle.encode(&prompt, true).map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
    let mut prepared = prepare(limits, tokens, &body.params, false)?;
    prepared.request.source = Some(PromptSource { bundle_hash: bundle.hash.clone(), input: PromptInput::Text { text: prompt } });
    Ok(prepared)
}

// ---- responses ----

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt tokens.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose keys and values the worker kept from an earlier request that began
    /// the same way (a system prompt, a chat's earlier turns): not computed again.
    pub cached_tokens: u32,
}

impl Usage {
    pub fn of(o: &RunOutcome) -> Self {
        Self {
            prompt_tokens: o.prompt_tokens,
            completion_tokens: o.completion_tokens,
            total_tokens: o.prompt_tokens + o.completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: o.cached_prompt_tokens },
        }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FailoverInfo {
    pub from: String,
    pub to: String,
    pub reason: String,
    /// Tokens already sent before the stream resumed on `to` (0: replayed from the start).
    pub resumed_after_tokens: u32,
}

/// A model split between a GPU and the CPU: its last `gpu_layers` of `layers` run on the GPU,
/// the first ones and the output head on the CPU, in the GPU worker's process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct SplitInfo {
    pub gpu_layers: u32,
    pub layers: u32,
}

impl From<headroom_worker::SplitLayers> for SplitInfo {
    fn from(s: headroom_worker::SplitLayers) -> Self {
        Self { gpu_layers: s.gpu_layers, layers: s.layers }
    }
}

impl SplitInfo {
    /// The `X-Headroom-Split` header: `22/32`, GPU layers of all layers.
    pub fn header(&self) -> String {
        format!("{}/{}", self.gpu_layers, self.layers)
    }
}

/// Where and how a request was served; in every JSON body and the final stream chunk.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct HeadroomInfo {
    pub request_id: String,
    /// cuda:N, sim or cpu.
    pub device: String,
    pub simulated: bool,
    pub degraded: bool,
    /// What failed or what admission found, with its figures.
    pub degraded_reason: Option<String>,
    /// The same in one plain sentence, for people (see `/v1/status`).
    pub degraded_summary: Option<String>,
    /// Set when the CPU worker runs a smaller fallback model.
    pub fallback_model: Option<String>,
    /// Set when the GPU worker that served it runs the model split with the CPU.
    pub split: Option<SplitInfo>,
    pub failovers: Vec<FailoverInfo>,
    pub queued_ms: f64,
    /// Prefill and decode time the worker measured (the attempt that finished).
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub admission: String,
    /// Served from the journal for a repeated Idempotency-Key: nothing ran again.
    pub from_journal: bool,
    /// Whether the request would have continued on the CPU worker had the GPU failed (false
    /// when the client sent `allow_cpu: false`).
    pub cpu_failover: bool,
}

impl HeadroomInfo {
    pub fn of(c: &Completion) -> Self {
        let o = &c.outcome;
        Self {
            request_id: o.request_id.clone(),
            device: o.device.label(),
            simulated: o.simulated,
            degraded: o.degraded,
            degraded_reason: o.degraded_reason.clone(),
            degraded_summary: o.degraded_summary.clone(),
            fallback_model: o.fallback_model.clone(),
            split: o.split.map(SplitInfo::from),
            failovers: o
                .failovers
                .iter()
                .map(|f| FailoverInfo { from: f.from.label(), to: f.to.label(), reason: f.reason.clone(), resumed_after_tokens: f.resumed_after_tokens })
                .collect(),
            queued_ms: c.queued_ms,
            prefill_ms: o.prefill_ms,
            decode_ms: o.decode_ms,
            admission: c.admission.clone(),
            from_journal: c.from_journal,
            cpu_failover: c.cpu_failover,
        }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallFunction {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: ToolCallFunction,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    pub role: String,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<()>,
    /// stop, length or tool_calls.
    pub finish_reason: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub headroom: HeadroomInfo,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<()>,
    pub finish_reason: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<TextChoice>,
    pub usage: Usage,
    pub headroom: HeadroomInfo,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// Headroom's own: what the model is and whether this server serves it.
    pub headroom: ModelDetails,
}

/// A model as Headroom holds it. Other models in the models folder are listed with `served: false`
/// (start `headroom serve --model NAME` to serve one) and only what their name tells.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelDetails {
    pub served: bool,
    pub path: String,
    /// `gguf` or `safetensors`.
    pub format: String,
    /// The type most weight bytes are stored in (`Q4_1`, `Q8_0`, `F32`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_bytes: Option<u64>,
    /// Bytes of weights the CPU worker holds (the file's packed tensors; a CUDA worker holds f32).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resident_bytes_per_worker: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_tokens: Option<u64>,
    /// Where the model is loaded now (`GET /v1/models`): `gpu`, `split` (layers on both),
    /// `cpu` (only the CPU worker holds it: no GPU, the GPU paused or failed, or its copy
    /// unloaded after its keep_alive), `unloaded` (installed, not served).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// A served model's role: `chat` or `embedding`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Bytes of weights each device holds now (`gpu`, `cpu`), as the workers report them.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub resident_bytes: Option<std::collections::BTreeMap<String, u64>>,
    /// When a request last used the model (Unix ms); absent before the first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_used_unix_ms: Option<u64>,
    /// The other served models whose CPU path runs on this model's CPU worker (one process,
    /// one queue, its weights in RAM once: their `resident_bytes.cpu` is the same worker's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cpu_worker_shared_with: Vec<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

pub fn finish_reason(o: &RunOutcome, tool_calls: bool) -> String {
    if tool_calls {
        return "tool_calls".into();
    }
    match o.finish_reason {
        headroom_model::FinishReason::Length => "length".into(),
        _ => "stop".into(),
    }
}

/// Tool calls in the Hermes/Qwen form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
/// (what tool-capable chat templates ask for), and the text around them. Call ids derive from
/// the request id, so a replay of the same request names the same calls.
pub fn parse_tool_calls(request_id: &str, text: &str) -> (String, Vec<ToolCall>) {
    let mut calls = Vec::new();
    let mut rest = String::new();
    let mut remaining = text;
    while let Some(start) = remaining.find("<tool_call>") {
        let after = &remaining[start + "<tool_call>".len()..];
        let Some(end) = after.find("</tool_call>") else { break };
        let body = after[..end].trim();
        match serde_json::from_str::<serde_json::Value>(body) {
            Ok(v) if v["name"].is_string() => {
                rest.push_str(&remaining[..start]);
                let arguments = match &v["arguments"] {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Null => "{}".into(),
                    other => other.to_string(),
                };
                calls.push(ToolCall {
                    id: format!("call_{}_{}", request_id.trim_start_matches("req_"), calls.len()),
                    kind: "function".into(),
                    function: ToolCallFunction { name: v["name"].as_str().unwrap_or_default().to_string(), arguments },
                });
            }
            // Not a well-formed call: leave the text as the model wrote it.
            _ => rest.push_str(&remaining[..start + "<tool_call>".len() + end + "</tool_call>".len()]),
        }
        remaining = &after[end + "</tool_call>".len()..];
    }
    rest.push_str(remaining);
    (rest.trim().to_string(), calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_are_parsed_and_named_after_the_request() {
        let text = "Let me look.\n<tool_call>{\"name\": \"lookup\", \"arguments\": {\"verse\": \"John 3:16\"}}</tool_call>";
        let (rest, calls) = parse_tool_calls("req_abc", text);
        assert_eq!(rest, "Let me look.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].id, "call_abc_0");
        assert_eq!(calls[0].function.name, "lookup");
        assert_eq!(calls[0].function.arguments, r#"{"verse":"John 3:16"}"#);
        let (rest, calls) = parse_tool_calls("r", "<tool_call>not json</tool_call> tail");
        assert!(calls.is_empty());
        assert_eq!(rest, "<tool_call>not json</tool_call> tail");
    }
}
