//! The endpoints. Handlers validate, hand the request to the router and render what it says:
//! the device that served it and whether that was degraded are on every response.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use futures_util::StreamExt;
use headroom_memory::Allowances;
use headroom_router::{CancelOutcome, Completion, Lane, Placement, RunRequest, StreamEvent, Submission, Ticket};
use headroom_worker::Fault;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{BroadcastStream, ReceiverStream};
use utoipa::{OpenApi, ToSchema};

use crate::embeddings::{self, EmbeddingItem, EmbeddingList, EmbeddingRequest, EmbeddingUsage};
use crate::error::{ApiError, ErrorBody};
use crate::openai::{self, ChatCompletion, ChatCompletionRequest, CompletionRequest, HeadroomInfo, ModelList, Prepared, TextCompletion, Usage};
use crate::AppState;

pub const REQUEST_ID: &str = "x-request-id";
pub const DEVICE: &str = "x-headroom-device";
pub const DEGRADED: &str = "x-headroom-degraded";
pub const DEGRADED_REASON: &str = "x-headroom-degraded-reason";
pub const ESTIMATED_DELAY: &str = "x-headroom-estimated-delay-ms";
/// Set when the GPU worker serving the request runs the model split: `gpu_layers/layers`.
pub const SPLIT: &str = "x-headroom-split";
/// Response headers a browser page may read.
pub const EXPOSED_HEADERS: [&str; 7] = [REQUEST_ID, DEVICE, SPLIT, DEGRADED, DEGRADED_REASON, ESTIMATED_DELAY, "retry-after"];
/// A client's stated timeout, in ms (also `headroom.timeout_ms` in the body).
pub const TIMEOUT_HEADER: &str = "x-headroom-timeout-ms";

type Shared = State<Arc<AppState>>;

pub fn new_request_id() -> String {
    format!("req_{:024x}", rand::random::<u128>() >> 32)
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[derive(OpenApi)]
#[openapi(
    info(title = "Headroom", description = "OpenAI-compatible local LLM service that survives running out of VRAM"),
    paths(
        chat_completions, completions, embeddings, models, request_status, cancel_request, status, settings, update_settings, events, healthz, readyz, metrics,
        crate::ollama::chat, crate::ollama::generate, crate::ollama::embed, crate::ollama::embeddings, crate::ollama::tags, crate::ollama::show, crate::ollama::ps, crate::ollama::version
    ),
    components(schemas(ErrorBody, StatusBody, ReadyBody, CancelBody, SettingsBody))
)]
pub struct ApiDoc;

pub fn router(state: Arc<AppState>, ui_dir: Option<std::path::PathBuf>) -> axum::Router {
    let mut r = axum::Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/v1/requests/{id}", get(request_status))
        .route("/v1/requests/{id}/cancel", post(cancel_request))
        .route("/v1/status", get(status))
        .route("/v1/settings", get(settings).patch(update_settings))
        .route("/v1/events", get(events))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .route("/v1/{*rest}", axum::routing::any(not_found))
        .merge(crate::ollama::routes());
    if state.sim_faults {
        r = r.route("/admin/sim/fault", post(sim_fault));
    }
    let r = match ui_dir {
        Some(dir) => r.fallback_service(tower_http::services::ServeDir::new(dir)),
        None => r.route("/", get(no_ui)).fallback(not_found),
    };
    r.with_state(state)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found("not_found", format!("no endpoint {}; see /openapi.json", uri.path()))
}

async fn no_ui() -> Html<&'static str> {
    Html(
        "<!doctype html><title>Headroom</title><h1>Headroom is running</h1>\
         <p>The web UI is not built here (<code>npm --prefix ui ci && npm --prefix ui run build</code>). \
         The API is at <code>/v1</code>: <a href=\"/v1/status\">status</a>, <a href=\"/v1/models\">models</a>, \
         <a href=\"/openapi.json\">OpenAPI</a>, <a href=\"/metrics\">metrics</a>.</p>",
    )
}

pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<(T, Bytes), ApiError> {
    let bytes = body.map_err(|e| {
        let mut err = ApiError::invalid(None, format!("cannot read the request body: {e}"));
        err.status = e.status();
        err
    })?;
    let value = serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(None, format!("invalid request body: {e}")))?;
    Ok((value, bytes))
}

/// Test-only: a server started with `HEADROOM_TEST_IGNORE_IDEMPOTENCY_KEY` ignores the
/// Idempotency-Key header (the pressure harness's negative control for duplicate side effects).
fn ignores_idempotency_keys() -> bool {
    static IGNORE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *IGNORE.get_or_init(|| std::env::var_os("HEADROOM_TEST_IGNORE_IDEMPOTENCY_KEY").is_some())
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

pub(crate) fn submission(headers: &HeaderMap, raw: &Bytes, prepared: &Prepared) -> Result<Submission, ApiError> {
    let key = header_str(headers, "idempotency-key").map(str::to_string);
    if key.as_deref().is_some_and(|k| k.is_empty() || k.len() > 255) {
        return Err(ApiError::invalid(None, "Idempotency-Key must be 1 to 255 characters"));
    }
    let key = key.filter(|_| !ignores_idempotency_keys());
    let header_timeout = match header_str(headers, TIMEOUT_HEADER) {
        Some(v) => Some(v.trim().parse::<u64>().map_err(|_| ApiError::invalid(None, format!("{TIMEOUT_HEADER}: {v:?} is not a number of milliseconds")))?),
        None => None,
    };
    Ok(Submission {
        run: RunRequest { request_id: new_request_id(), request: prepared.request.clone(), allow_resume: prepared.allow_resume },
        idempotency_key: key,
        body_hash: hex::encode(Sha256::digest(raw)),
        stream: prepared.stream,
        allow: Allowances { shrink: prepared.allow_shrink, cpu: prepared.allow_cpu, max_wait_ms: prepared.timeout_ms.or(header_timeout) },
    })
}

/// Sanitised for a header: visible ASCII only.
fn header_value(text: &str) -> HeaderValue {
    let clean: String = text.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).take(512).collect();
    HeaderValue::from_str(&clean).unwrap_or_else(|_| HeaderValue::from_static("?"))
}

/// The router's placement of a request, as response headers.
fn apply_placement(placement: &Placement, headers: &mut HeaderMap) {
    headers.insert(REQUEST_ID, header_value(&placement.request_id));
    headers.insert(DEVICE, header_value(&placement.device));
    if let Some(split) = placement.split {
        headers.insert(SPLIT, header_value(&openai::SplitInfo::from(split).header()));
    }
    headers.insert(DEGRADED, HeaderValue::from_static(if placement.degraded() { "true" } else { "false" }));
    if let Some(d) = &placement.degradation {
        headers.insert(DEGRADED_REASON, header_value(&d.reason));
    }
    if let Some(d) = placement.estimated_delay_ms {
        headers.insert(ESTIMATED_DELAY, HeaderValue::from(d));
    }
}

pub(crate) fn with_placement(mut response: Response, placement: &Placement) -> Response {
    apply_placement(placement, response.headers_mut());
    response
}

/// Tool calls in a finished chat, recorded in the journal before the client sees them (a
/// replay of this request can then never deliver them again). A call that cannot be recorded
/// is not delivered: the client gets an error and retries with its key.
fn tool_calls(state: &AppState, c: &Completion, tools: bool) -> Result<(String, Vec<openai::ToolCall>), ApiError> {
    if !tools {
        return Ok((c.outcome.text.clone(), Vec::new()));
    }
    let (text, calls) = openai::parse_tool_calls(&c.outcome.request_id, &c.outcome.text);
    for call in &calls {
        state.dispatcher.record_tool_call(&c.outcome.request_id, &call.id, &call.function.name, &call.function.arguments).map_err(|e| {
            ApiError::internal(format!("the request journal could not record tool call {} ({e}), so it is not delivered; retry with the same Idempotency-Key once the server's disk is writable", call.id))
        })?;
    }
    Ok((text, calls))
}

#[utoipa::path(
    post, path = "/v1/chat/completions", request_body = ChatCompletionRequest,
    description = "OpenAI chat completions. With `stream: true` the answer is `text/event-stream` chunks ending in `data: [DONE]`.",
    responses(
        (status = 200, description = "The completion (or an SSE stream of chunks)", body = ChatCompletion),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
        (status = 409, description = "Idempotency-Key reused with another body, or cancelled", body = ErrorBody),
        (status = 503, description = "No capacity now: see Retry-After", body = ErrorBody),
    )
)]
async fn chat_completions(State(state): Shared, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let (request, raw): (ChatCompletionRequest, Bytes) = parse_body(body)?;
    let state = state.for_model(&request.model)?;
    state.check_role(crate::Role::Chat)?;
    let prepared = openai::prepare_chat(&state.bundle, &state.limits_now(), &request)?;
    serve(state, &headers, &raw, prepared, Kind::Chat).await
}

#[utoipa::path(
    post, path = "/v1/completions", request_body = CompletionRequest,
    description = "OpenAI (legacy) text completions; `stream: true` gives SSE chunks.",
    responses(
        (status = 200, description = "The completion", body = TextCompletion),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
        (status = 503, description = "No capacity now", body = ErrorBody),
    )
)]
async fn completions(State(state): Shared, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let (request, raw): (CompletionRequest, Bytes) = parse_body(body)?;
    let state = state.for_model(&request.model)?;
    state.check_role(crate::Role::Chat)?;
    let prepared = openai::prepare_completion(&state.bundle, &state.limits_now(), &request)?;
    serve(state, &headers, &raw, prepared, Kind::Text).await
}

#[utoipa::path(
    post, path = "/v1/embeddings", request_body = EmbeddingRequest,
    description = "OpenAI embeddings: one vector per input string (the served model's hidden states after the final norm, mean-pooled, length 1). Each input is a request like a chat: journaled, admitted, batched, failed over to the CPU worker; each item's `headroom` says where it ran.",
    responses(
        (status = 200, description = "The embeddings, in input order", body = EmbeddingList),
        (status = 400, description = "Invalid request (empty input, token ids, too long)", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
        (status = 503, description = "No capacity now", body = ErrorBody),
    )
)]
async fn embeddings(State(state): Shared, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let (request, raw): (EmbeddingRequest, Bytes) = parse_body(body)?;
    let state = state.for_model(&request.model)?;
    state.check_role(crate::Role::Embedding)?;
    let base64 = embeddings::check_openai(&request, state.bundle.config.hidden_size)?;
    let texts = embeddings::texts(&request.input, "input")?;
    let ask = embeddings::Ask { field: "input", texts, truncate: false, limit: state.limits_now().context_tokens, options: request.headroom.clone().unwrap_or_default() };
    let done = embeddings::embed(&state, &headers, &raw, ask).await?;
    let data = done
        .iter()
        .enumerate()
        .map(|(index, c)| EmbeddingItem {
            object: "embedding".into(),
            index: index as u32,
            embedding: if base64 { json!(embeddings::base64_floats(embeddings::vector(c))) } else { json!(embeddings::vector(c)) },
            headroom: HeadroomInfo::of(c),
        })
        .collect();
    let prompt_tokens = done.iter().map(|c| c.outcome.prompt_tokens).sum();
    let placement = embeddings::placement(&done);
    let list = EmbeddingList { object: "list".into(), data, model: state.model_id.clone(), usage: EmbeddingUsage { prompt_tokens, total_tokens: prompt_tokens } };
    Ok(with_placement(Json(list).into_response(), &placement))
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

async fn serve(state: Arc<AppState>, headers: &HeaderMap, raw: &Bytes, prepared: Prepared, kind: Kind) -> Result<Response, ApiError> {
    let sub = submission(headers, raw, &prepared)?;
    let ticket = state.dispatcher.submit(sub)?;
    let placement = state.dispatcher.placement(&ticket);
    if prepared.stream {
        return Ok(with_placement(stream(state, ticket, prepared, kind, &placement), &placement));
    }
    let request_id = ticket.request_id.clone();
    let completion = ticket.finish().await.map_err(|e| {
        let mut err = ApiError::from(e);
        err.message = format!("{} (request {request_id}; GET /v1/requests/{request_id} shows its history)", err.message);
        err
    })?;
    let (text, calls) = tool_calls(&state, &completion, prepared.tools && kind == Kind::Chat)?;
    let o = &completion.outcome;
    let common = (format!("{}-{}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, o.request_id), now_unix(), o.fallback_model.clone().unwrap_or_else(|| state.model_id.clone()), format!("fp_{}", state.bundle.short_hash()));
    let response = match kind {
        Kind::Chat => Json(ChatCompletion {
            id: common.0,
            object: "chat.completion".into(),
            created: common.1,
            model: common.2,
            system_fingerprint: common.3,
            choices: vec![openai::ChatChoice {
                index: 0,
                finish_reason: openai::finish_reason(o, !calls.is_empty()),
                message: openai::AssistantMessage { role: "assistant".into(), content: Some(text), tool_calls: calls },
                logprobs: None,
            }],
            usage: Usage::of(o),
            headroom: HeadroomInfo::of(&completion),
        })
        .into_response(),
        Kind::Text => Json(TextCompletion {
            id: common.0,
            object: "text_completion".into(),
            created: common.1,
            model: common.2,
            system_fingerprint: common.3,
            choices: vec![openai::TextChoice { index: 0, text, logprobs: None, finish_reason: openai::finish_reason(o, false) }],
            usage: Usage::of(o),
            headroom: HeadroomInfo::of(&completion),
        })
        .into_response(),
    };
    Ok(with_placement(response, &completion.placement()))
}

/// OpenAI's SSE chunks. A failover mid-stream shows as a `headroom` notice on the next chunk
/// (clients that do not know it ignore it); the last chunk carries the full `headroom` object.
fn stream(state: Arc<AppState>, mut ticket: Ticket, prepared: Prepared, kind: Kind, placement: &Placement) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let id = format!("{}-{}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, ticket.request_id);
    let created = now_unix();
    let model = state.model_id.clone();
    let fingerprint = format!("fp_{}", state.bundle.short_hash());
    let mut device = placement.device.clone();
    let degraded = placement.degraded();
    let (degraded_reason, degraded_summary) = placement.degradation.clone().map(|d| (d.reason, d.summary)).unzip();
    tokio::spawn(async move {
        let chunk = |choice: Value, headroom: Option<Value>| -> Event {
            let mut c = json!({
                "id": id, "object": if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
                "created": created, "model": model, "system_fingerprint": fingerprint,
                "choices": if choice.is_null() { json!([]) } else { json!([choice]) },
            });
            if let Some(h) = headroom {
                c["headroom"] = h;
            }
            Event::default().data(c.to_string())
        };
        let content = |text: &str, finish: Option<String>| -> Value {
            match kind {
                Kind::Chat => json!({"index": 0, "delta": if text.is_empty() && finish.is_some() { json!({}) } else { json!({"content": text}) }, "logprobs": null, "finish_reason": finish}),
                Kind::Text => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            }
        };
        let first = json!({"request_id": ticket.request_id, "device": device, "degraded": degraded, "degraded_reason": degraded_reason, "degraded_summary": degraded_summary});
        let opening = match kind {
            Kind::Chat => chunk(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}), Some(first)),
            Kind::Text => chunk(content("", None), Some(first)),
        };
        if tx.send(Ok(opening)).await.is_err() {
            return; // the client left; dropping the ticket cancels the request
        }
        // With tools the text may be a call: it is sent whole at the end, parsed.
        let hold_text = prepared.tools && kind == Kind::Chat;
        let mut streamed = 0usize;
        loop {
            let event = tokio::select! {
                t = ticket.next_event() => t,
                _ = tx.closed() => return,
            };
            let token = match event {
                None => break,
                Some(StreamEvent::Token(token)) => token,
                Some(StreamEvent::Waiting(w)) => {
                    // Left its device: the client hears where it waits and for about how long.
                    let n = json!({"notice": "waiting", "queue": w.queue, "ahead": w.ahead, "estimated_delay_ms": w.estimated_delay_ms, "degraded": true,
                        "message": format!("{}; waiting for the {} worker ({} ahead{})", w.reason, w.queue, w.ahead,
                            w.estimated_delay_ms.map(|d| format!(", about {d} ms")).unwrap_or_default())});
                    if tx.send(Ok(chunk(Value::Null, Some(n)))).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let notice = (token.device.label() != device).then(|| {
                // A fallback model cannot continue another model's text: it starts over.
                let restarted = token.index == 0 && streamed > 0;
                let message = if restarted {
                    format!("the {device} worker failed; {} answers again from the start with its own model: discard the text so far", token.device)
                } else {
                    format!("the {device} worker failed; continuing on {} after {} tokens", token.device, token.index)
                };
                let n = json!({"notice": if restarted { "restart" } else { "failover" }, "from": device, "to": token.device, "degraded": true, "message": message});
                device = token.device.label();
                n
            });
            if hold_text || (token.text.is_empty() && notice.is_none()) {
                continue;
            }
            streamed += 1;
            if tx.send(Ok(chunk(content(&token.text, None), notice))).await.is_err() {
                return;
            }
        }
        let end = match ticket.finish().await {
            Ok(c) => c,
            Err(e) => {
                let err = ApiError::from(e);
                let _ = tx.send(Ok(Event::default().data(json!({"error": err.body().error}).to_string()))).await;
                let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
                return;
            }
        };
        let (text, calls) = match tool_calls(&state, &end, hold_text) {
            Ok(r) => r,
            Err(err) => {
                let _ = tx.send(Ok(Event::default().data(json!({"error": err.body().error}).to_string()))).await;
                let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
                return;
            }
        };
        // Attached to a request another client streams, or served from the journal: the text
        // arrives whole.
        if (hold_text || streamed == 0) && !text.is_empty() {
            let _ = tx.send(Ok(chunk(content(&text, None), None))).await;
        }
        if !calls.is_empty() {
            let deltas: Vec<Value> = calls
                .iter()
                .enumerate()
                .map(|(i, c)| json!({"index": i, "id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}))
                .collect();
            let _ = tx.send(Ok(chunk(json!({"index": 0, "delta": {"tool_calls": deltas}, "logprobs": null, "finish_reason": null}), None))).await;
        }
        let info = serde_json::to_value(HeadroomInfo::of(&end)).unwrap_or_default();
        let _ = tx.send(Ok(chunk(content("", Some(openai::finish_reason(&end.outcome, !calls.is_empty()))), Some(info)))).await;
        if prepared.include_usage {
            let usage = Event::default().data(json!({"id": id, "object": if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" }, "created": created, "model": model, "system_fingerprint": fingerprint, "choices": [], "usage": Usage::of(&end.outcome)}).to_string());
            let _ = tx.send(Ok(usage)).await;
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    });
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))).into_response()
}

fn served_model_details(state: &AppState) -> openai::ModelDetails {
    let bundle = &state.bundle;
    let config = &bundle.config;
    let parameters = config.parameter_count() as u64;
    openai::ModelDetails {
        served: true,
        path: bundle.path.display().to_string(),
        format: bundle.format.container.clone(),
        quantization: Some(bundle.format.quantization.clone()),
        architecture: Some(config.model_type.clone()),
        parameters: Some(parameters),
        file_bytes: Some(bundle.weight_file_bytes),
        resident_bytes_per_worker: Some(bundle.cpu_weight_bytes),
        context_tokens: Some(config.max_position_embeddings as u64),
        state: None,
        role: Some(state.role.as_str().into()),
        resident_bytes: None,
        last_used_unix_ms: None,
        cpu_worker_shared_with: Vec::new(),
    }
}

/// Where the served model is loaded now, what each device holds of it, its last use, and the
/// other models of `served` that share its CPU worker.
fn served_model_now(state: &AppState, s: &headroom_router::ServiceStatus, served: &[Arc<AppState>]) -> openai::ModelDetails {
    let gpu = s.workers.iter().find(|w| w.lane == headroom_router::Lane::Gpu && w.pid.is_some() && w.state != headroom_router::WorkerState::Unloaded);
    let mut resident = std::collections::BTreeMap::new();
    if let (Some(_), Some(reading)) = (gpu, s.gpu_memory.as_ref()) {
        resident.insert("gpu".to_string(), reading.weights_bytes);
        if reading.host_weights_bytes > 0 {
            resident.insert("cpu_split".to_string(), reading.host_weights_bytes);
        }
    }
    if let Some(reading) = state.dispatcher.supervisor().cpu_worker().and_then(|w| w.memory().borrow().clone()) {
        resident.insert("cpu".to_string(), reading.weights_bytes);
    }
    let where_now = match gpu {
        Some(w) if w.split.is_some() => "split",
        Some(_) => "gpu",
        None => "cpu",
    };
    let used = state.dispatcher.supervisor().last_used();
    let cpu = state.dispatcher.supervisor().shared_cpu();
    openai::ModelDetails {
        state: Some(where_now.into()),
        resident_bytes: Some(resident),
        last_used_unix_ms: used.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_millis() as u64),
        cpu_worker_shared_with: served.iter().filter(|m| m.model_id != state.model_id && m.dispatcher.supervisor().shared_cpu().same_as(&cpu)).map(|m| m.model_id.clone()).collect(),
        ..served_model_details(state)
    }
}

/// The served models first, with what each is and where it is loaded; then the other models
/// installed in the models folder.
fn model_cards(state: &Arc<AppState>) -> Vec<openai::ModelCard> {
    let card = |id: String, headroom: openai::ModelDetails| openai::ModelCard { id, object: "model".into(), created: state.created_unix, owned_by: "headroom".into(), headroom };
    let served = state.served();
    let mut cards: Vec<openai::ModelCard> = served.iter().map(|m| card(m.model_id.clone(), served_model_now(m, &m.dispatcher.status(), &served))).collect();
    let served_paths: Vec<_> = served.iter().filter_map(|m| m.bundle.path.canonicalize().ok()).collect();
    for path in headroom_model::bundle::installed_models() {
        if path.canonicalize().ok().is_some_and(|p| served_paths.contains(&p)) {
            continue;
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let gguf = name.ends_with(".gguf");
        let id = name.strip_suffix(".gguf").unwrap_or(&name).to_owned();
        cards.push(card(
            id,
            openai::ModelDetails {
                served: false,
                path: path.display().to_string(),
                format: if gguf { "gguf" } else { "safetensors" }.into(),
                quantization: None,
                architecture: None,
                parameters: None,
                file_bytes: if gguf { std::fs::metadata(&path).ok().map(|m| m.len()) } else { None },
                resident_bytes_per_worker: None,
                context_tokens: None,
                state: Some("unloaded".into()),
                role: None,
                resident_bytes: None,
                last_used_unix_ms: None,
                cpu_worker_shared_with: Vec::new(),
            },
        ));
    }
    cards
}

#[utoipa::path(get, path = "/v1/models", responses((status = 200, description = "The served model first, then the other installed models", body = ModelList)))]
async fn models(State(state): Shared) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: model_cards(&state),
    })
}

#[utoipa::path(
    get, path = "/v1/requests/{id}", params(("id" = String, Path, description = "The request id (X-Request-Id)")),
    responses((status = 200, description = "The request's journal record and history", body = Object), (status = 404, description = "Unknown id", body = ErrorBody))
)]
async fn request_status(State(state): Shared, Path(id): Path<String>) -> Result<Response, ApiError> {
    let state = owner_of(&state, &id);
    let journal = state.dispatcher.journal();
    let record = journal.get(&id)?;
    let transitions = journal.transitions(&id)?;
    let mut body = serde_json::to_value(&record).map_err(|e| ApiError::internal(e.to_string()))?;
    // The stored body holds prompt token ids; the client knows its prompt.
    if let Some(o) = body.as_object_mut() {
        o.remove("body");
        o.insert("transitions".into(), serde_json::to_value(transitions).unwrap_or_default());
        o.insert("tool_calls_delivered".into(), json!(journal.tool_calls_delivered(&id)?));
    }
    let mut response = Json(body).into_response();
    response.headers_mut().insert(REQUEST_ID, header_value(&id));
    Ok(response)
}

/// The served model whose journal holds request `id` (each model keeps its own); the first
/// model when none does, which answers the 404.
fn owner_of(state: &Arc<AppState>, id: &str) -> Arc<AppState> {
    let served = state.served();
    served.iter().find(|m| m.dispatcher.journal().get(id).is_ok()).cloned().unwrap_or_else(|| state.clone())
}

#[derive(Serialize, ToSchema)]
pub struct CancelBody {
    pub id: String,
    /// true: it was queued or running and is being stopped; false: it had already ended.
    pub cancelled: bool,
    pub state: String,
}

#[utoipa::path(
    post, path = "/v1/requests/{id}/cancel", params(("id" = String, Path, description = "The request id")),
    responses((status = 200, description = "Cancelled, or already ended", body = CancelBody), (status = 404, description = "Unknown id", body = ErrorBody))
)]
async fn cancel_request(State(state): Shared, Path(id): Path<String>) -> Result<Response, ApiError> {
    let state = owner_of(&state, &id);
    let outcome = state.dispatcher.cancel(&id)?;
    let (cancelled, s) = match outcome {
        CancelOutcome::Cancelled => (true, "cancelling".to_string()),
        CancelOutcome::AlreadyEnded(s) => (false, serde_json::to_value(s).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()),
    };
    let mut response = Json(CancelBody { id: id.clone(), cancelled, state: s }).into_response();
    response.headers_mut().insert(REQUEST_ID, header_value(&id));
    Ok(response)
}

#[derive(Serialize, ToSchema)]
pub struct WorkerInfo {
    /// gpu or cpu.
    pub kind: String,
    /// cuda:N, sim or cpu.
    pub device: String,
    pub pid: Option<u32>,
    /// ready, starting (loaded, memory not reported yet), probing (half-open breaker), unhealthy,
    /// paused (in settings), or down (restarting or failed).
    pub state: String,
    pub simulated: bool,
    pub model: Option<String>,
    pub bundle_hash: Option<String>,
    /// Set while this GPU worker runs the model split with the CPU.
    pub split: Option<openai::SplitInfo>,
    /// The longest prompt + reply this worker accepts (tokens).
    pub context_tokens: Option<u32>,
}

#[derive(Serialize, ToSchema)]
pub struct StatusBody {
    pub model: String,
    /// What the served model is: format, quantization, parameters, sizes.
    pub model_info: openai::ModelDetails,
    pub degraded: bool,
    /// What failed or what admission found, with its figures.
    pub degraded_reason: Option<String>,
    /// The same in one plain sentence: what happened, which model on the CPU answers, how much
    /// slower, up to how many tokens.
    pub degraded_summary: Option<String>,
    /// The GPU is paused in settings: requests go to the CPU worker by choice, not failure.
    pub gpu_paused: bool,
    /// closed, open or half_open.
    pub breaker: String,
    pub workers: Vec<WorkerInfo>,
    #[schema(value_type = Vec<Object>)]
    pub queues: Value,
    pub estimated_delay_ms: Option<u64>,
    #[schema(value_type = Object)]
    pub memory: Value,
    /// Where the model's layers live, as planned at the GPU worker's latest launch: `placement` ("all on the GPU",
    /// "split: 22 of 32 layers on the GPU", "all on the CPU"), each device's bytes, the reason,
    /// and a split's predicted decode tokens/s (an upper bound from each device's bandwidth).
    #[schema(value_type = Option<Object>)]
    pub placement: Option<Value>,
    /// The GPU's copy of the model (absent without a GPU): `state` (`loaded`; `unloaded` after
    /// its keep_alive, loaded again by the next GPU request; `loading`), the `keep_alive` in
    /// force (`"5m"`, `"-1"` = never), `unloads_in_ms` while loaded and idle, `idle_ms`.
    #[schema(value_type = Option<Object>)]
    pub gpu_residency: Option<Value>,
    /// Every served model (the first is the one this status describes): `id`, `role`, where it
    /// is loaded now (`state`: gpu, split, cpu), the bytes each device holds, its last use and
    /// its GPU residency. Several models share one GPU: admission for each counts the others,
    /// and evicts idle ones (not pinned) before sending a request to the CPU.
    #[schema(value_type = Vec<Object>)]
    pub models: Vec<Value>,
}

/// The GPU memory none of the served models holds: a driver's reading counts every process, so
/// the used bytes less what each model holds; the sim GPU's reading is one worker's own, whose
/// competing workload stands for the other programs. From the first model with a GPU worker.
fn gpu_other_bytes(state: &Arc<AppState>) -> Option<u64> {
    let served = state.served();
    let reading = served.iter().find_map(|m| m.dispatcher.supervisor().gpu_worker().and_then(|w| w.memory().borrow().clone()))?;
    if reading.simulated {
        return Some(reading.competing_bytes);
    }
    let models: u64 = served.iter().map(|m| m.dispatcher.held_on_gpu()).map(|(w, h)| w + h).sum();
    Some(reading.used_bytes?.saturating_sub(models))
}

fn status_body(state: &Arc<AppState>) -> StatusBody {
    let s = state.dispatcher.status();
    let served = state.served();
    let breaker = serde_json::to_value(s.breaker).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    let workers = s
        .workers
        .iter()
        .map(|w| WorkerInfo {
            kind: w.lane.to_string(),
            device: w.device.label(),
            pid: w.pid,
            state: w.state.to_string(),
            simulated: w.simulated,
            model: w.model.clone(),
            bundle_hash: w.bundle_hash.clone(),
            split: w.split.map(openai::SplitInfo::from),
            context_tokens: w.context_tokens,
        })
        .collect();
    let memory = json!({
        "gpu": s.gpu_memory,
        // What admission works with: the reserve kept free for other programs, and what
        // requests hold (the larger of the router's grants and the worker's last sample).
        "vram_reserve_bytes": s.gpu_budget.map(|b| b.reserve_bytes),
        "gpu_held_bytes": s.gpu_budget.map(|b| b.held_bytes),
        // What anything but the served models holds on the GPU: other programs (the sim GPU's
        // competing workload) and allocator slack.
        "gpu_other_bytes": gpu_other_bytes(state),
        "host": headroom_memory::observe::host_memory(),
        // Host RAM admission reserved for CPU-path requests, and the CPU worker's KV blocks
        // alive: reserved against used.
        "host_reserved_bytes": s.host_reserved_bytes,
        "cpu_kv_resident_bytes": s.cpu_kv_resident_bytes,
        // The GPU's KV cache in blocks (sim GPU): written against reserved, overcommit and
        // preemptions.
        "gpu_kv": s.gpu_kv,
        // Finished requests' KV blocks the CPU worker keeps for prompts that begin the same way.
        "cpu_prefix_cache": s.cpu_prefix_cache.map(|p| {
            let mut value = serde_json::to_value(p).unwrap_or_default();
            value["hit_rate"] = json!(p.hit_rate());
            value
        }),
    });
    StatusBody {
        model: state.model_id.clone(),
        model_info: served_model_details(state),
        degraded: s.degraded(),
        degraded_reason: s.degradation.as_ref().map(|d| d.reason.clone()),
        degraded_summary: s.degradation.as_ref().map(|d| d.summary.clone()),
        gpu_paused: s.gpu_paused,
        breaker,
        workers,
        queues: serde_json::to_value(&s.queues).unwrap_or_default(),
        estimated_delay_ms: s.estimated_delay_ms,
        memory,
        placement: state.dispatcher.supervisor().placement().map(|p| {
            let mut value = serde_json::to_value(&p).unwrap_or_default();
            value["placement"] = Value::from(p.placement());
            value
        }),
        gpu_residency: s.gpu_residency.as_ref().and_then(|r| serde_json::to_value(r).ok()),
        models: served
            .iter()
            .map(|m| {
                let s = m.dispatcher.status();
                let now = served_model_now(m, &s, &served);
                let (gpu_weights, gpu_held) = m.dispatcher.held_on_gpu();
                json!({
                    "id": m.model_id,
                    "role": m.role.as_str(),
                    "state": now.state,
                    "resident_bytes": now.resident_bytes,
                    // What admission charges the model on the shared GPU: its weights (while
                    // loading, those it is about to take) and its requests' grants.
                    "gpu_weights_bytes": gpu_weights,
                    "gpu_held_bytes": gpu_held,
                    "last_used_unix_ms": now.last_used_unix_ms,
                    "gpu_residency": s.gpu_residency,
                    "gpu_pid": m.dispatcher.supervisor().gpu_worker().map(|w| w.pid),
                    "cpu_pid": m.dispatcher.supervisor().cpu_worker().map(|w| w.pid),
                    "cpu_worker_shared_with": now.cpu_worker_shared_with,
                    "breaker": s.breaker,
                    // Each model's own degraded mode: the tray and the page follow every model.
                    "degraded": s.degradation.is_some(),
                    "degraded_summary": s.degradation.map(|d| d.summary),
                    "queues": s.queues,
                })
            })
            .collect(),
    }
}

#[utoipa::path(get, path = "/v1/status", responses((status = 200, description = "Devices, breaker, queues, delay and memory", body = StatusBody)))]
async fn status(State(state): Shared) -> Json<StatusBody> {
    Json(status_body(&state))
}

/// The settings in force, as `GET /v1/settings` and a change return them.
#[derive(Serialize, ToSchema)]
pub struct SettingsBody {
    /// The model these settings are for: its fallback model and layer count are its own; the
    /// other settings are the service's, the same for every model.
    pub model: String,
    #[schema(value_type = Object)]
    pub settings: headroom_router::Settings,
    /// Settings changed by this request (empty for GET).
    pub changed: Vec<String>,
    /// Changed settings that take effect at the next start.
    pub restart_required: Vec<String>,
    /// Where the settings are saved, if anywhere.
    pub file: Option<String>,
}

/// `?model=<id>`: which served model's settings (default: the first model's).
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct SettingsQuery {
    /// A served model's id (see `GET /v1/models`); default: the first model.
    model: Option<String>,
}

/// The served model a settings call names, or the first one.
fn settings_target(state: &Arc<AppState>, query: Result<Query<SettingsQuery>, QueryRejection>) -> Result<Arc<AppState>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::invalid("model", format!("{e}; pass ?model=<id> with a served model's id")))?;
    match query.model {
        Some(model) => state.for_model(&model),
        None => Ok(state.clone()),
    }
}

#[utoipa::path(
    get, path = "/v1/settings", params(SettingsQuery),
    responses(
        (status = 200, description = "The settings in force", body = SettingsBody),
        (status = 404, description = "No served model has that id", body = ErrorBody),
    )
)]
async fn settings(State(state): Shared, query: Result<Query<SettingsQuery>, QueryRejection>) -> Result<Json<SettingsBody>, ApiError> {
    let target = settings_target(&state, query)?;
    Ok(Json(SettingsBody { model: target.model_id.clone(), settings: target.dispatcher.settings(), changed: Vec::new(), restart_required: Vec::new(), file: target.dispatcher.settings_path() }))
}

#[utoipa::path(
    patch, path = "/v1/settings", params(SettingsQuery),
    description = "Changes settings with a JSON merge patch, e.g. `{\"vram_reserve_mib\": 2048, \"gpu_paused\": true}`; `null` resets an optional one. Applied at once where possible (`restart_required` lists the rest) and saved. The fallback model and the layer count are the named model's (`?model=`, default the first); the other settings apply to every served model.",
    request_body(content = Object, description = "The settings to change"),
    responses(
        (status = 200, description = "Applied and saved", body = SettingsBody),
        (status = 400, description = "Unknown setting or invalid value; nothing changed", body = ErrorBody),
        (status = 404, description = "No served model has that id", body = ErrorBody),
        (status = 409, description = "Valid, but the CPU worker could not start with it; nothing changed", body = ErrorBody),
        (status = 500, description = "Applied but not saved", body = ErrorBody),
    )
)]
async fn update_settings(State(state): Shared, query: Result<Query<SettingsQuery>, QueryRejection>, body: Result<Bytes, BytesRejection>) -> Result<Json<SettingsBody>, ApiError> {
    let target = settings_target(&state, query)?;
    let (patch, _): (Value, Bytes) = parse_body(body)?;
    check_gpu_layers(&target, &patch)?;
    let update = target.dispatcher.update_settings(&patch).await?;
    // The service-wide settings (the VRAM reserve, the GPU's pause, the CPU workers' concurrency
    // and context) apply to every served model; the fallback model and the layer count are
    // the named model's own.
    if let Some(fields) = patch.as_object() {
        let shared: serde_json::Map<String, Value> = fields.iter().filter(|(k, _)| !headroom_router::MODEL_SETTINGS.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect();
        if !shared.is_empty() {
            for other in state.served().iter().filter(|m| m.model_id != target.model_id) {
                if let Err(e) = other.dispatcher.update_settings(&Value::Object(shared.clone())).await {
                    tracing::warn!(model = %other.model_id, error = %e, "a settings change did not apply to this model");
                }
            }
        }
    }
    Ok(Json(SettingsBody { model: target.model_id.clone(), settings: update.settings, changed: update.changed, restart_required: update.restart_required, file: target.dispatcher.settings_path() }))
}

/// A fixed `gpu_layers` must fit: at most the layers the latest plan found room for (with its
/// guaranteed context) on the GPU, and no more than the model has.
fn check_gpu_layers(state: &AppState, patch: &Value) -> Result<(), ApiError> {
    let Some(Ok(headroom_memory::GpuLayers::Count(n))) = patch.get("gpu_layers").filter(|v| !v.is_null()).map(|v| serde_json::from_value(v.clone())) else {
        return Ok(());
    };
    let layers = state.bundle.config.num_hidden_layers as u32;
    if n > layers {
        return Err(ApiError::invalid("gpu_layers", format!("gpu_layers = {n}, but {} has {layers} layers; give at most {layers}, or \"auto\"", state.model_id)));
    }
    // Test-only: the fit is not checked (the negative control of the API test).
    let checked = !headroom_model::test_defect("gpu-layers-unchecked");
    if let Some(plan) = state.dispatcher.supervisor().placement().filter(|p| checked && n > p.most_gpu_layers) {
        return Err(ApiError::invalid(
            "gpu_layers",
            format!(
                "gpu_layers = {n} does not fit: at most {} of the {layers} layers fit in the {} the GPU can give the model (free VRAM less the reserve) with {} tokens of context; give at most {}, or \"auto\"",
                plan.most_gpu_layers,
                headroom_memory::footprint::human_bytes(plan.gpu_usable_bytes),
                plan.context_tokens,
                plan.most_gpu_layers
            ),
        ));
    }
    Ok(())
}

#[utoipa::path(get, path = "/v1/events", description = "Server-sent service events (breaker, degraded, workers, failovers, memory samples, queue depth), one JSON object each, named by their `event` field.", responses((status = 200, description = "text/event-stream")))]
async fn events(State(state): Shared) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let first = Event::default().event("status").data(serde_json::to_string(&status_body(&state)).unwrap_or_default());
    // Every served model's events, each with its `model`; of the models beside the first, the
    // lifecycle ones (loads, evictions, workers, failovers, breaker, degraded), not their memory
    // samples and queue depths, which the status and the UI's chart describe for the first.
    let streams = state.served().into_iter().enumerate().map(|(i, m)| {
        let model = m.model_id.clone();
        BroadcastStream::new(m.dispatcher.subscribe()).filter_map(move |e| {
            let event = match e {
                Ok(event) => {
                    let mut value = serde_json::to_value(&event).unwrap_or_default();
                    let name = value["event"].as_str().unwrap_or("event").to_string();
                    if i > 0 && (name == "memory_sample" || name == "queue_changed") {
                        None
                    } else {
                        value["model"] = json!(model);
                        Some(Event::default().event(name).data(value.to_string()))
                    }
                }
                Err(tokio_stream::wrappers::errors::BroadcastStreamRecvError::Lagged(n)) => Some(Event::default().event("lagged").data(json!({"missed": n, "model": model}).to_string())),
            };
            std::future::ready(event.map(Ok))
        })
    });
    let live = futures_util::stream::select_all(streams.map(Box::pin));
    Sse::new(futures_util::stream::once(async { Ok(first) }).chain(live)).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "The process is alive")))]
async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

#[derive(Serialize, ToSchema)]
pub struct ReadyBody {
    pub ready: bool,
    pub degraded: bool,
    pub reason: Option<String>,
}

#[utoipa::path(get, path = "/readyz", responses((status = 200, description = "Requests can be served", body = ReadyBody), (status = 503, description = "No worker can serve now", body = ReadyBody)))]
async fn readyz(State(state): Shared) -> Response {
    let s = state.dispatcher.status();
    let journal_fault = state.dispatcher.journal_fault();
    let running = |lane: Lane| s.workers.iter().any(|w| w.lane == lane && w.pid.is_some());
    let workers = running(Lane::Cpu) || (running(Lane::Gpu) && !s.degraded());
    let ready = workers && journal_fault.is_none();
    let reason = journal_fault
        .or_else(|| (!workers).then(|| "no worker is running; the CPU worker is restarting".to_string()))
        .or_else(|| s.degradation.as_ref().map(|d| d.reason.clone()));
    let body = ReadyBody { ready, degraded: s.degraded(), reason };
    let code = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(body)).into_response()
}

#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text exposition")))]
async fn metrics(State(state): Shared) -> Response {
    let served = state.served();
    let body = if served.len() > 1 {
        // Several models: each one's dispatcher metrics, every sample labelled with its model.
        let parts: Vec<(String, String)> = served.iter().map(|m| (m.model_id.clone(), m.dispatcher.metrics_text())).collect();
        crate::exposition::merge_by_model(&parts, &model_metrics(&state))
    } else {
        let text = state.dispatcher.metrics_text();
        // The served model's residency, before the exposition's end marker.
        match text.strip_suffix("# EOF\n") {
            Some(head) => format!("{head}{}# EOF\n", model_metrics(&state)),
            None => text,
        }
    };
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}

/// Each served model's residency in Prometheus text: whether the GPU holds it, the weight
/// bytes each device holds, and its GPU unloads (keep_alive and evictions), with a `model` label.
fn model_metrics(state: &Arc<AppState>) -> String {
    let label = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
    let mut loaded = String::from("# HELP headroom_model_loaded_on_gpu 1 while the GPU holds the model (several models share one GPU; idle ones are evicted for others)\n# TYPE headroom_model_loaded_on_gpu gauge\n");
    let mut resident = String::from("# HELP headroom_model_resident_bytes Weight bytes of the model each device holds now\n# TYPE headroom_model_resident_bytes gauge\n");
    let mut loads = String::from("# HELP headroom_model_gpu_loads Times the model was loaded on the GPU for a request (after an unload, an eviction, or a start without it)\n# TYPE headroom_model_gpu_loads counter\n");
    let mut unloads = String::from("# HELP headroom_model_gpu_unloads Times the GPU's copy of the model was unloaded (keep_alive) or evicted for another model\n# TYPE headroom_model_gpu_unloads counter\n");
    let served = state.served();
    for m in &served {
        let now = served_model_now(m, &m.dispatcher.status(), &served);
        let model = label(&m.model_id);
        let on_gpu = matches!(now.state.as_deref(), Some("gpu") | Some("split"));
        loaded.push_str(&format!("headroom_model_loaded_on_gpu{{model=\"{model}\",role=\"{}\"}} {}\n", m.role.as_str(), u8::from(on_gpu)));
        for (device, bytes) in now.resident_bytes.unwrap_or_default() {
            resident.push_str(&format!("headroom_model_resident_bytes{{model=\"{model}\",device=\"{}\"}} {bytes}\n", label(&device)));
        }
        unloads.push_str(&format!("headroom_model_gpu_unloads_total{{model=\"{model}\"}} {}\n", m.dispatcher.gpu_model_unloads()));
        loads.push_str(&format!("headroom_model_gpu_loads_total{{model=\"{model}\"}} {}\n", m.dispatcher.supervisor().gpu_loads()));
    }
    format!("{loaded}{resident}{loads}{unloads}")
}

async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// `--gpu sim` only: inject a fault into the simulated GPU (`{"fault": "oom_next_allocation"}`,
/// `{"fault": "reset", "after_tokens": 4}`, `{"fault": "clear"}`, ...).
async fn sim_fault(State(state): Shared, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let (fault, raw): (Fault, Bytes) = parse_body(body)?;
    // With several models, `"model"` names whose sim GPU worker takes it. Without it, a fault
    // of the device's surroundings (a competing program, a slowdown, clear) bites every model,
    // as they share the one GPU; any other goes to the first model's worker.
    let named = serde_json::from_slice::<Value>(&raw).ok().and_then(|v| v["model"].as_str().map(str::to_string));
    let targets = match named {
        Some(model) => vec![state.for_model(&model)?],
        None if fault.is_environment() => state.served(),
        None => vec![state],
    };
    for target in &targets {
        target
            .dispatcher
            .supervisor()
            .inject_fault(fault.clone())
            .await
            .map_err(|e| ApiError::unavailable(format!("cannot inject the fault into {}: {e}", target.model_id), 1))?;
    }
    Ok(Json(json!({"injected": fault, "models": targets.iter().map(|t| t.model_id.clone()).collect::<Vec<_>>()})))
}
