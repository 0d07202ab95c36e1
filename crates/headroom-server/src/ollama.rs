//! Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
//! `/api/version`) on the same server, for the clients built for Ollama. One request path, two
//! wire formats: a request is translated into the OpenAI shape [`openai`] validates, submitted
//! to the dispatcher like any (admission, journal, `Idempotency-Key`, failover, cancel on
//! disconnect), and its answer written as Ollama's JSON or NDJSON stream. Errors are Ollama's
//! `{"error": "..."}` with the same status codes as the OpenAI routes. Headroom's extras (the
//! device, degraded, failovers, queue wait) ride in a `headroom` object on the final object and
//! in the usual `X-Headroom-*` headers; Ollama clients ignore both.

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use headroom_memory::KeepAlive;
use headroom_router::StreamEvent;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::openai::{self, ChatCompletionRequest, CompletionRequest, HeadroomInfo, Limits, Prepared};
use crate::routes::{parse_body, submission, with_placement};
use crate::AppState;

type Shared = State<Arc<AppState>>;

/// The Ollama version these routes follow (what `GET /api/version` says; clients check it).
pub const OLLAMA_VERSION: &str = "0.5.0";

pub fn routes() -> axum::Router<Arc<AppState>> {
    axum::Router::new()
        .route("/api/version", get(version))
        .route("/api/tags", get(tags))
        .route("/api/ps", get(ps))
        .route("/api/show", post(show))
        .route("/api/chat", post(chat))
        .route("/api/generate", post(generate))
        .route("/api/embed", post(embed))
        .route("/api/embeddings", post(embeddings))
}

/// An [`ApiError`] in Ollama's shape: `{"error": message}`, same status and headers.
pub(crate) struct OllamaError(ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        let mut response = (self.0.status, Json(json!({"error": self.0.message}))).into_response();
        if let Some(s) = self.0.retry_after_s {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

pub(crate) type Result<T> = std::result::Result<T, OllamaError>;

/// Ollama's sampling and length options that map onto Headroom's; others are ignored, as
/// Ollama ignores options a model does not use.
#[derive(Debug, Default)]
struct Options {
    num_ctx: Option<i64>,
    num_predict: Option<i64>,
    temperature: Option<f32>,
    top_k: Option<u32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Vec<String>>,
    repeat_penalty: Option<f32>,
}

impl Options {
    /// Reads `options`, each value checked on its own so an error names the option.
    fn read(value: Option<&Value>) -> Result<Self> {
        let map = match value {
            None | Some(Value::Null) => return Ok(Self::default()),
            Some(Value::Object(map)) => map,
            Some(other) => return Err(ApiError::invalid("options", format!("options must be an object of Ollama's options, not {other}")).into()),
        };
        fn get<T: serde::de::DeserializeOwned>(map: &Map<String, Value>, key: &str) -> Result<Option<T>> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|e| ApiError::invalid("options", format!("options.{key} = {v}: {e}")).into()),
            }
        }
        Ok(Self {
            num_ctx: get(map, "num_ctx")?,
            num_predict: get(map, "num_predict")?,
            temperature: get(map, "temperature")?,
            top_k: get(map, "top_k")?,
            top_p: get(map, "top_p")?,
            seed: get(map, "seed")?,
            stop: get(map, "stop")?,
            repeat_penalty: get(map, "repeat_penalty")?,
        })
    }
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    model: String,
    #[serde(default)]
    messages: Vec<Value>,
    stream: Option<bool>,
    format: Option<Value>,
    options: Option<Value>,
    tools: Option<Value>,
    keep_alive: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct GenerateBody {
    model: String,
    #[serde(default)]
    prompt: String,
    system: Option<String>,
    #[serde(default)]
    raw: bool,
    stream: Option<bool>,
    format: Option<Value>,
    options: Option<Value>,
    images: Option<Vec<Value>>,
    keep_alive: Option<Value>,
}

/// The served model under Ollama's names: its id, `id:tag` (any tag names it), or `default`.
/// Anything else is a 404 naming what is served.
fn check_model(state: &Arc<AppState>, requested: &str) -> Result<Arc<AppState>> {
    if requested.is_empty() {
        return Err(ApiError::invalid("model", format!("model is required; this server serves {}", state.served_names())).into());
    }
    state.for_model(requested).map_err(|_| ApiError::not_found("model_not_found", format!("model {requested:?} not found; this server serves {} (GET /api/tags)", state.served_names())).into())
}

/// Reads a request's `keep_alive` (400 naming the forms when it is none of them). Ollama's
/// meaning: how long the model stays loaded after this request, replacing what was in force.
fn read_keep_alive(value: &Option<Value>) -> Result<Option<KeepAlive>> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => KeepAlive::from_json(v).map(Some).map_err(|e| ApiError::invalid("keep_alive", e).into()),
    }
}

/// Ollama's load and unload calls: a generate with an empty prompt or a chat with no messages
/// loads the model (on the GPU, if its keep_alive had unloaded it) and answers at once;
/// with `keep_alive: 0` it unloads the GPU's copy instead, once no request uses it.
async fn load_or_unload(state: &AppState, keep_alive: Option<KeepAlive>, shape: Shape, started: Instant) -> Response {
    let (key, value) = shape.piece("");
    let done_reason = if keep_alive == Some(KeepAlive::For(std::time::Duration::ZERO)) {
        state.dispatcher.unload_if_idle();
        "unload"
    } else {
        state.dispatcher.load_gpu().await;
        "load"
    };
    let mut body = Map::new();
    body.insert("model".into(), json!(model_name(state)));
    body.insert("created_at".into(), json!(created_at()));
    body.insert(key.into(), value);
    body.insert("done".into(), json!(true));
    body.insert("done_reason".into(), json!(done_reason));
    if done_reason == "load" {
        body.insert("total_duration".into(), json!(started.elapsed().as_nanos() as u64));
        body.insert("load_duration".into(), json!(started.elapsed().as_nanos() as u64));
    }
    Json(Value::Object(body)).into_response()
}

/// `format` asks for constrained output (JSON, a schema): not supported, refused clearly
/// rather than answered with free text a client would fail to parse.
fn check_format(format: &Option<Value>) -> Result<()> {
    match format {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s.is_empty() => Ok(()),
        Some(_) => Err(ApiError::invalid("format", "format (JSON or schema-constrained output) is not supported by Headroom; ask for JSON in the prompt and validate it, or leave format out").into()),
    }
}

/// The OpenAI parameters of Ollama's options, and the context they allow.
fn translate_options(options: Option<Value>, limits: &Limits, stream: bool, into: &mut Map<String, Value>) -> Result<Limits> {
    let o = Options::read(options.as_ref())?;
    let mut limits = limits.clone();
    if let Some(n) = o.num_ctx {
        if n < 1 {
            return Err(ApiError::invalid("options", format!("options.num_ctx = {n}: give a positive number of tokens")).into());
        }
        // Ollama cuts a prompt longer than num_ctx silently; a context beyond what is served
        // is refused, and a smaller one is the limit the request is checked against.
        if n as usize > limits.context_tokens {
            return Err(ApiError::invalid(
                "options",
                format!("options.num_ctx = {n} is beyond the {} tokens of context served here; give at most {}, or leave it out", limits.context_tokens, limits.context_tokens),
            )
            .into());
        }
        limits.context_tokens = n as usize;
    }
    match o.num_predict {
        // -1 (until a stop) and -2 (fill the context): the server's default length, capped by
        // the context like any request.
        None | Some(-1) | Some(-2) => {}
        Some(n) if n > 0 => {
            into.insert("max_tokens".into(), json!(n));
        }
        Some(n) => return Err(ApiError::invalid("options", format!("options.num_predict = {n}: give a positive number of tokens, or -1")).into()),
    }
    let mut put = |key: &str, v: Option<Value>| {
        if let Some(v) = v {
            into.insert(key.into(), v);
        }
    };
    put("temperature", o.temperature.map(|v| json!(v)));
    put("top_k", o.top_k.map(|v| json!(v)));
    put("top_p", o.top_p.map(|v| json!(v)));
    put("seed", o.seed.map(|v| json!(v)));
    put("stop", o.stop.filter(|s| !s.is_empty()).map(|v| json!(v)));
    put("repetition_penalty", o.repeat_penalty.map(|v| json!(v)));
    put("stream", Some(json!(stream)));
    Ok(limits)
}

fn created_at() -> String {
    rfc3339(std::time::SystemTime::now())
}

/// `2026-12-06T10:41:07.123Z`: Ollama's `created_at`, in UTC.
fn rfc3339(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let (secs, millis) = (d.as_secs() as i64, d.subsec_millis());
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// Which of Ollama's answers: `message` (chat) or `response` (generate).
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Chat,
    Generate,
}

impl Shape {
    fn piece(self, text: &str) -> (&'static str, Value) {
        match self {
            Shape::Chat => ("message", json!({"role": "assistant", "content": text})),
            Shape::Generate => ("response", json!(text)),
        }
    }
}

/// The final object's fields: why it stopped, and the timings in nanoseconds as the worker
/// measured them (`total_duration` from the request's arrival).
fn final_fields(c: &headroom_router::Completion, started: Instant) -> Map<String, Value> {
    let o = &c.outcome;
    let ns = |ms: f64| (ms * 1e6).round() as u64;
    let mut m = Map::new();
    m.insert("done".into(), json!(true));
    m.insert("done_reason".into(), json!(openai::finish_reason(o, false)));
    m.insert("total_duration".into(), json!(started.elapsed().as_nanos() as u64));
    // Non-zero when the model had been unloaded (keep_alive) and loaded for this request.
    m.insert("load_duration".into(), json!(ns(c.load_ms)));
    m.insert("prompt_eval_count".into(), json!(o.prompt_tokens));
    m.insert("prompt_eval_duration".into(), json!(ns(o.prefill_ms)));
    m.insert("eval_count".into(), json!(o.completion_tokens));
    m.insert("eval_duration".into(), json!(ns(o.decode_ms)));
    m.insert("headroom".into(), serde_json::to_value(HeadroomInfo::of(c)).unwrap_or_default());
    m
}

#[utoipa::path(get, path = "/api/version", tag = "ollama", description = "Ollama's version endpoint: the Ollama API version these routes follow.", responses((status = 200, description = "`{\"version\": ...}`")))]
pub(crate) async fn version() -> Json<Value> {
    Json(json!({"version": OLLAMA_VERSION}))
}

/// What `/api/tags` and `/api/show` say about the served model.
fn details(state: &AppState) -> Value {
    let bundle = &state.bundle;
    let parameters = bundle.config.parameter_count() as f64;
    let size = if parameters >= 1e9 { format!("{:.1}B", parameters / 1e9) } else { format!("{:.0}M", parameters / 1e6) };
    json!({
        "parent_model": "",
        "format": bundle.format.container,
        "family": bundle.config.model_type,
        "families": [bundle.config.model_type],
        "parameter_size": size,
        "quantization_level": bundle.format.quantization,
    })
}

fn model_name(state: &AppState) -> String {
    format!("{}:latest", state.model_id)
}

#[utoipa::path(get, path = "/api/tags", tag = "ollama", description = "Ollama's model list: the served model as `name:latest`, its size and details.", responses((status = 200, description = "`{\"models\": [...]}`")))]
pub(crate) async fn tags(State(state): Shared) -> Json<Value> {
    let models: Vec<Value> = state.served().iter().map(|state| {
        let modified = std::fs::metadata(&state.bundle.path).and_then(|m| m.modified()).map(rfc3339).unwrap_or_else(|_| created_at());
        json!({
            "name": model_name(state),
            "model": model_name(state),
            "modified_at": modified,
            "size": state.bundle.weight_file_bytes,
            "digest": state.bundle.short_hash(),
            "details": details(state),
        })
    }).collect();
    Json(json!({"models": models}))
}

/// The loaded model, with the device it runs on and the bytes it holds there and on the host.
#[utoipa::path(get, path = "/api/ps", tag = "ollama", description = "Ollama's loaded models: the served model, its VRAM and host bytes, and in `headroom` the device it runs on and whether it is degraded.", responses((status = 200, description = "`{\"models\": [...]}`")))]
pub(crate) async fn ps(State(state): Shared) -> Json<Value> {
    Json(json!({"models": state.served().iter().map(|s| loaded_model(s)).collect::<Vec<_>>()}))
}

/// One model as `/api/ps` lists it.
fn loaded_model(state: &AppState) -> Value {
    let status = state.dispatcher.status();
    let gpu = status.workers.iter().find(|w| w.lane == headroom_router::Lane::Gpu);
    let residency = status.gpu_residency.as_ref();
    let gpu_loaded = residency.is_none_or(|r| r.state == "loaded");
    let vram = gpu.filter(|_| gpu_loaded).and_then(|_| status.gpu_memory.as_ref().map(|m| m.weights_bytes + m.reserved_bytes)).unwrap_or(0);
    // When the GPU's copy unloads; the CPU worker's copy stays (it is the failover), so the
    // model stays listed, with no VRAM once the GPU's copy is gone.
    let expires_at = residency
        .and_then(|r| r.unloads_in_ms)
        .map(|ms| rfc3339(std::time::SystemTime::now() + std::time::Duration::from_millis(ms)))
        .unwrap_or_else(|| "0001-01-01T00:00:00Z".into());
    json!({
        "name": model_name(&state),
        "model": model_name(&state),
        "size": state.bundle.cpu_weight_bytes + vram,
        "size_vram": vram,
        "digest": state.bundle.short_hash(),
        "details": details(&state),
        "expires_at": expires_at,
        "headroom": {
            "gpu_residency": residency,
            "device": gpu.map(|g| g.device.label()).unwrap_or_else(|| "cpu".into()),
            "degraded": status.degraded(),
            "degraded_reason": status.degradation.as_ref().map(|d| &d.reason),
            "degraded_summary": status.degradation.as_ref().map(|d| &d.summary),
            "workers": status.workers.iter().map(|w| json!({"kind": w.lane.to_string(), "device": w.device.label(), "state": w.state.to_string()})).collect::<Vec<_>>(),
        },
    })
}

#[derive(Deserialize)]
struct ShowBody {
    #[serde(alias = "name")]
    model: String,
}

#[utoipa::path(post, path = "/api/show", tag = "ollama", description = "Ollama's model details: family, parameter size, quantization, context length, template.",
    request_body(content = Object, description = "`{\"model\": \"name[:tag]\"}`"),
    responses((status = 200, description = "The details"), (status = 400, description = "Invalid request: `{\"error\": ...}`"), (status = 404, description = "Not the served model: `{\"error\": ...}`")))]
pub(crate) async fn show(State(state): Shared, body: std::result::Result<Bytes, BytesRejection>) -> Result<Json<Value>> {
    let (request, _): (ShowBody, Bytes) = parse_body(body)?;
    let state = check_model(&state, &request.model)?;
    let config = &state.bundle.config;
    let arch = config.model_type.clone();
    Ok(Json(json!({
        "license": "",
        "modelfile": format!("FROM {}\n", state.bundle.path.display()),
        "parameters": "",
        "template": state.bundle.template.as_ref().map(|t| t.source.clone()).unwrap_or_default(),
        "details": details(&state),
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": config.parameter_count(),
            format!("{arch}.context_length"): config.max_position_embeddings,
            format!("{arch}.embedding_length"): config.hidden_size,
            format!("{arch}.block_count"): config.num_hidden_layers,
            format!("{arch}.attention.head_count"): config.num_attention_heads,
            format!("{arch}.attention.head_count_kv"): config.num_key_value_heads,
        },
        "capabilities": ["completion"],
    })))
}

#[utoipa::path(post, path = "/api/chat", tag = "ollama", description = "Ollama's chat: NDJSON stream by default (`stream: false` for one object), `options` mapped (num_ctx, num_predict, temperature, top_k, top_p, seed, stop, repeat_penalty); through the same admission, journal, Idempotency-Key, failover and cancellation as /v1/chat/completions.",
    request_body(content = Object, description = "Ollama's chat request"),
    responses((status = 200, description = "The answer, or `application/x-ndjson` objects ending in `done: true`"), (status = 400, description = "Invalid request: `{\"error\": ...}`"), (status = 404, description = "Not the served model"), (status = 409, description = "Idempotency-Key reused with another body"), (status = 503, description = "No capacity now: see Retry-After")))]
pub(crate) async fn chat(State(state): Shared, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Result<Response> {
    let started = Instant::now();
    let (request, raw): (ChatBody, Bytes) = parse_body(body)?;
    let state = check_model(&state, &request.model)?;
    check_format(&request.format)?;
    // Ollama's clients send `tools: []` when there are none.
    if request.tools.as_ref().is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(ApiError::invalid("tools", "tools are served on POST /v1/chat/completions (OpenAI's shape); /api/chat answers in text").into());
    }
    let keep_alive = read_keep_alive(&request.keep_alive)?;
    let stream = request.stream.unwrap_or(true);
    let mut openai_body = Map::new();
    let limits = translate_options(request.options, &state.limits_now(), stream, &mut openai_body)?;
    if request.messages.is_empty() {
        keep_alive.inspect(|k| state.dispatcher.set_keep_alive(*k));
        return Ok(load_or_unload(&state, keep_alive, Shape::Chat, started).await);
    }
    state.check_role(crate::Role::Chat)?;
    let mut messages = Vec::with_capacity(request.messages.len());
    for (i, m) in request.messages.iter().enumerate() {
        if m.get("images").is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(ApiError::invalid("messages", format!("messages[{i}] has images: this model reads text only")).into());
        }
        messages.push(json!({"role": m.get("role").cloned().unwrap_or(Value::Null), "content": m.get("content").cloned().unwrap_or(json!(""))}));
    }
    openai_body.insert("model".into(), json!(state.model_id));
    openai_body.insert("messages".into(), Value::Array(messages));
    let body: ChatCompletionRequest = serde_json::from_value(Value::Object(openai_body)).map_err(|e| ApiError::invalid("messages", format!("messages: {e}")))?;
    let prepared = openai::prepare_chat(&state.bundle, &limits, &body)?;
    keep_alive.inspect(|k| state.dispatcher.set_keep_alive(*k));
    answer(state, &headers, &raw, prepared, Shape::Chat, started).await
}

#[utoipa::path(post, path = "/api/generate", tag = "ollama", description = "Ollama's generate: a prompt (with `system`, or `raw` without the chat template); NDJSON stream by default; an empty prompt answers `done_reason: load`.",
    request_body(content = Object, description = "Ollama's generate request"),
    responses((status = 200, description = "The answer, or `application/x-ndjson` objects ending in `done: true`"), (status = 400, description = "Invalid request: `{\"error\": ...}`"), (status = 404, description = "Not the served model"), (status = 409, description = "Idempotency-Key reused with another body"), (status = 503, description = "No capacity now: see Retry-After")))]
pub(crate) async fn generate(State(state): Shared, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Result<Response> {
    let started = Instant::now();
    let (request, raw): (GenerateBody, Bytes) = parse_body(body)?;
    let state = check_model(&state, &request.model)?;
    check_format(&request.format)?;
    if request.images.as_ref().is_some_and(|i| !i.is_empty()) {
        return Err(ApiError::invalid("images", "images were sent: this model reads text only").into());
    }
    let keep_alive = read_keep_alive(&request.keep_alive)?;
    if request.prompt.is_empty() {
        keep_alive.inspect(|k| state.dispatcher.set_keep_alive(*k));
        return Ok(load_or_unload(&state, keep_alive, Shape::Generate, started).await);
    }
    state.check_role(crate::Role::Chat)?;
    let stream = request.stream.unwrap_or(true);
    let mut openai_body = Map::new();
    let limits = translate_options(request.options, &state.limits_now(), stream, &mut openai_body)?;
    openai_body.insert("model".into(), json!(state.model_id));
    let prepared = if request.raw {
        // The prompt as given, no template.
        openai_body.insert("prompt".into(), json!(request.prompt));
        let body: CompletionRequest = serde_json::from_value(Value::Object(openai_body)).map_err(|e| ApiError::invalid("prompt", format!("prompt: {e}")))?;
        openai::prepare_completion(&state.bundle, &limits, &body)?
    } else {
        let mut messages = Vec::new();
        if let Some(system) = request.system.filter(|s| !s.is_empty()) {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": request.prompt}));
        openai_body.insert("messages".into(), Value::Array(messages));
        let body: ChatCompletionRequest = serde_json::from_value(Value::Object(openai_body)).map_err(|e| ApiError::invalid("prompt", format!("prompt: {e}")))?;
        openai::prepare_chat(&state.bundle, &limits, &body)?
    };
    keep_alive.inspect(|k| state.dispatcher.set_keep_alive(*k));
    answer(state, &headers, &raw, prepared, Shape::Generate, started).await
}

#[derive(Debug, Deserialize)]
struct EmbedBody {
    model: String,
    input: Option<Value>,
    truncate: Option<bool>,
    dimensions: Option<u32>,
    options: Option<Value>,
    keep_alive: Option<Value>,
}

#[utoipa::path(post, path = "/api/embed", tag = "ollama", description = "Ollama's embeddings: `input` a string or an array of strings, one vector each (length 1), through the same path as /v1/embeddings. An input longer than the model takes is a 400 naming the limit, unless the client sends `truncate: true`; `options.num_ctx` lowers that limit.",
    request_body(content = Object, description = "Ollama's embed request"),
    responses((status = 200, description = "`{\"model\", \"embeddings\": [[...]], \"total_duration\", \"load_duration\", \"prompt_eval_count\", \"headroom\"}`"), (status = 400, description = "Invalid request: `{\"error\": ...}`"), (status = 404, description = "Not the served model"), (status = 503, description = "No capacity now: see Retry-After")))]
pub(crate) async fn embed(State(state): Shared, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Result<Response> {
    let started = Instant::now();
    let (request, raw): (EmbedBody, Bytes) = parse_body(body)?;
    let state = check_model(&state, &request.model)?;
    state.check_role(crate::Role::Embedding)?;
    let Some(input) = request.input.as_ref() else {
        return Err(ApiError::invalid("input", "input is required: a string or an array of strings").into());
    };
    let texts = crate::embeddings::texts(input, "input")?;
    crate::embeddings::check_dimensions(request.dimensions, state.bundle.config.hidden_size)?;
    let mut unused = Map::new();
    let limits = translate_options(request.options, &state.limits_now(), false, &mut unused)?;
    let ask = crate::embeddings::Ask { field: "input", texts, truncate: request.truncate == Some(true), limit: limits.context_tokens, options: Default::default() };
    read_keep_alive(&request.keep_alive)?.inspect(|k| state.dispatcher.set_keep_alive(*k));
    let done = crate::embeddings::embed(&state, &headers, &raw, ask).await?;
    let embeddings: Vec<&[f32]> = done.iter().map(crate::embeddings::vector).collect();
    let placement = crate::embeddings::placement(&done);
    let headroom: Vec<HeadroomInfo> = done.iter().map(HeadroomInfo::of).collect();
    let body = json!({
        "model": model_name(&state),
        "embeddings": embeddings,
        "total_duration": started.elapsed().as_nanos() as u64,
        "load_duration": (done.iter().map(|c| c.load_ms).fold(0.0, f64::max) * 1e6).round() as u64,
        "prompt_eval_count": done.iter().map(|c| c.outcome.prompt_tokens).sum::<u32>(),
        "headroom": headroom,
    });
    Ok(with_placement(Json(body).into_response(), &placement))
}

#[derive(Debug, Deserialize)]
struct EmbeddingsBody {
    model: String,
    prompt: Option<String>,
    options: Option<Value>,
    keep_alive: Option<Value>,
}

#[utoipa::path(post, path = "/api/embeddings", tag = "ollama", description = "Ollama's older embeddings route, still used by many integrations: one `prompt`, answered `{\"embedding\": [...]}` through the same path as /api/embed (the vector has length 1 here too).",
    request_body(content = Object, description = "`{\"model\", \"prompt\"}`"),
    responses((status = 200, description = "`{\"embedding\": [...]}`"), (status = 400, description = "Invalid request: `{\"error\": ...}`"), (status = 404, description = "Not the served model"), (status = 503, description = "No capacity now: see Retry-After")))]
pub(crate) async fn embeddings(State(state): Shared, headers: HeaderMap, body: std::result::Result<Bytes, BytesRejection>) -> Result<Response> {
    let (request, raw): (EmbeddingsBody, Bytes) = parse_body(body)?;
    let state = check_model(&state, &request.model)?;
    state.check_role(crate::Role::Embedding)?;
    let Some(prompt) = request.prompt else {
        return Err(ApiError::invalid("prompt", "prompt is required: the text to embed").into());
    };
    let texts = crate::embeddings::texts(&Value::String(prompt), "prompt")?;
    let mut unused = Map::new();
    let limits = translate_options(request.options, &state.limits_now(), false, &mut unused)?;
    let ask = crate::embeddings::Ask { field: "prompt", texts, truncate: false, limit: limits.context_tokens, options: Default::default() };
    read_keep_alive(&request.keep_alive)?.inspect(|k| state.dispatcher.set_keep_alive(*k));
    let done = crate::embeddings::embed(&state, &headers, &raw, ask).await?;
    let body = json!({"embedding": crate::embeddings::vector(&done[0]), "headroom": HeadroomInfo::of(&done[0])});
    Ok(with_placement(Json(body).into_response(), &done[0].placement()))
}

/// Submits the request and writes its answer: one object, or an NDJSON stream whose last
/// object (`done: true`) carries the timings and the `headroom` object.
async fn answer(state: Arc<AppState>, headers: &HeaderMap, raw: &Bytes, prepared: Prepared, shape: Shape, started: Instant) -> Result<Response> {
    let sub = submission(headers, raw, &prepared)?;
    let mut ticket = state.dispatcher.submit(sub).map_err(ApiError::from)?;
    let placement = state.dispatcher.placement(&ticket);
    let model = model_name(&state);
    if !prepared.stream {
        let request_id = ticket.request_id.clone();
        let completion = ticket.finish().await.map_err(|e| {
            let mut err = ApiError::from(e);
            err.message = format!("{} (request {request_id}; GET /v1/requests/{request_id} shows its history)", err.message);
            err
        })?;
        let (key, value) = shape.piece(&completion.outcome.text);
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        body.insert("created_at".into(), json!(created_at()));
        body.insert(key.into(), value);
        body.extend(final_fields(&completion, started));
        return Ok(with_placement(Json(Value::Object(body)).into_response(), &completion.placement()));
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<std::result::Result<Bytes, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let line = |mut v: Value| {
            v["model"] = json!(model);
            v["created_at"] = json!(created_at());
            let mut text = v.to_string();
            text.push('\n');
            Ok(Bytes::from(text))
        };
        let mut streamed = 0usize;
        // Test-only: end the stream with an error when the request changes device, as a server
        // without failover does (the negative control of the failover test).
        let ends_at_failover = headroom_model::test_defect("ollama-stream-ends-at-failover");
        let mut device = None;
        loop {
            let event = tokio::select! {
                e = ticket.next_event() => e,
                // The client left: dropping the ticket cancels the request.
                _ = tx.closed() => return,
            };
            match event {
                None => break,
                Some(StreamEvent::Token(token)) if ends_at_failover && *device.get_or_insert(token.device) != token.device => {
                    let _ = tx.send(line(json!({"error": "the GPU failed mid-answer"}))).await;
                    return;
                }
                Some(StreamEvent::Token(token)) if !token.text.is_empty() => {
                    streamed += 1;
                    let (key, value) = shape.piece(&token.text);
                    if tx.send(line(json!({key: value, "done": false}))).await.is_err() {
                        return;
                    }
                }
                // Waits and failovers show on the final object's `headroom` (and in
                // /v1/events); Ollama's stream has no place for a notice.
                Some(_) => {}
            }
        }
        match ticket.finish().await {
            Ok(end) => {
                // Attached to a request another client streams, or served from the journal:
                // the text arrives whole.
                if streamed == 0 && !end.outcome.text.is_empty() {
                    let (key, value) = shape.piece(&end.outcome.text);
                    let _ = tx.send(line(json!({key: value, "done": false}))).await;
                }
                let (key, value) = shape.piece("");
                let mut last = Map::new();
                last.insert(key.into(), value);
                last.extend(final_fields(&end, started));
                let _ = tx.send(line(Value::Object(last))).await;
            }
            Err(e) => {
                let err = ApiError::from(e);
                let _ = tx.send(line(json!({"error": err.message}))).await;
            }
        }
    });
    let mut response = Response::new(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    *response.status_mut() = StatusCode::OK;
    Ok(with_placement(response, &placement))
}

#[cfg(test)]
mod tests {
    #[test]
    fn created_at_is_rfc3339_in_utc() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_796_553_667_123);
        assert_eq!(super::rfc3339(t), "2026-12-06T10:41:07.123Z");
        assert_eq!(super::rfc3339(std::time::UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        // A leap day.
        assert_eq!(super::rfc3339(std::time::UNIX_EPOCH + std::time::Duration::from_secs(951_782_400)), "2000-02-29T00:00:00.000Z");
    }
}
