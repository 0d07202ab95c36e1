//! Embeddings: OpenAI's `POST /v1/embeddings` and Ollama's `POST /api/embed`, two wire formats
//! over one path. Each input is one request through the router like a chat (journaled,
//! admitted, batched with the running generations, failed over to the CPU worker, cancelled
//! when the client goes away); its worker answers with the served model's embedding instead of
//! tokens: the mean of the input's hidden states after the final norm, scaled to length 1
//! (`headroom_model::Session::embedding`). A chat model serves them until a dedicated embedding
//! model can be served beside it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use base64::Engine as _;
use futures_util::{StreamExt, TryStreamExt};
use headroom_model::{GenerateRequest, PromptInput, PromptSource};
use headroom_router::Completion;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::openai::{HeadroomInfo, HeadroomOptions, Prepared};
use crate::routes::submission;
use crate::AppState;

/// Inputs one request may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// Inputs of one request submitted at once: enough to fill the GPU's and the CPU worker's
/// batches (4 each by default).
const IN_FLIGHT: usize = 8;

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct EmbeddingRequest {
    /// The served model's id (GET /v1/models), or `default`.
    #[schema(example = "default")]
    pub model: String,
    /// A string, or an array of strings (one embedding each, in order). Token-id arrays are
    /// refused: Headroom tokenizes with the model's own tokenizer.
    #[schema(value_type = Object)]
    pub input: Value,
    /// `float` (default) or `base64` (little-endian f32s).
    pub encoding_format: Option<String>,
    /// Only the model's own width is served.
    pub dimensions: Option<u32>,
    pub user: Option<String>,
    pub headroom: Option<HeadroomOptions>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingList {
    /// `list`.
    pub object: String,
    pub data: Vec<EmbeddingItem>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingItem {
    /// `embedding`.
    pub object: String,
    pub index: u32,
    /// Floats, or a base64 string of little-endian f32s.
    #[schema(value_type = Object)]
    pub embedding: Value,
    /// Where this input ran, degraded or not, its failovers.
    pub headroom: HeadroomInfo,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingUsage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
}

/// The texts of an `input` field: a string or an array of strings, none empty.
pub(crate) fn texts(input: &Value, field: &'static str) -> Result<Vec<String>, ApiError> {
    let tokens_refused = || {
        ApiError::invalid(
            field,
            format!("{field} holds token ids: Headroom embeds text with the model's own tokenizer; send strings (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)"),
        )
    };
    let texts: Vec<String> = match input {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => {
            let mut texts = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Value::String(s) => texts.push(s.clone()),
                    Value::Number(_) | Value::Array(_) => return Err(tokens_refused()),
                    other => return Err(ApiError::invalid(field, format!("{field} must be a string or an array of strings, not an array holding {other}"))),
                }
            }
            texts
        }
        other => return Err(ApiError::invalid(field, format!("{field} must be a string or an array of strings, not {other}"))),
    };
    if texts.is_empty() {
        return Err(ApiError::invalid(field, format!("{field} is an empty array: send at least one string")));
    }
    if texts.len() > MAX_INPUTS {
        return Err(ApiError::invalid(field, format!("{} inputs: at most {MAX_INPUTS} per request; send the rest in another", texts.len())));
    }
    if let Some(i) = texts.iter().position(|t| t.trim().is_empty()) {
        let which = if input.is_string() { field.to_string() } else { format!("{field}[{i}]") };
        return Err(ApiError::invalid(field, format!("{which} is empty: every input needs some text to embed")));
    }
    Ok(texts)
}

/// How the embeddings of one HTTP request run.
pub(crate) struct Ask {
    /// The `input` field's name, for errors.
    pub field: &'static str,
    pub texts: Vec<String>,
    /// Cut an input longer than the model takes to its first tokens (Ollama's `truncate: true`,
    /// when the client sends it); otherwise such an input is a 400 naming the limit.
    pub truncate: bool,
    /// Tokens an input may have: the served context, or a client's smaller one.
    pub limit: usize,
    pub options: HeadroomOptions,
}

/// Submits one request per text (at most [`IN_FLIGHT`] at a time) and waits for all of them;
/// their completions in order. A failure drops the others' tickets, which cancels them.
pub(crate) async fn embed(state: &Arc<AppState>, headers: &HeaderMap, raw: &Bytes, ask: Ask) -> Result<Vec<Completion>, ApiError> {
    let limit = ask.limit;
    let field = ask.field;
    let mut requests = Vec::with_capacity(ask.texts.len());
    for (i, text) in ask.texts.iter().enumerate() {
        let mut tokens = state.bundle.encode(text, true).map_err(|e| ApiError::invalid(field, format!("{field}[{i}]: {e}")))?;
        if tokens.len() > limit {
            if !ask.truncate {
                return Err(ApiError::invalid(
                    field,
                    format!("{field}[{i}] is {} tokens, but this model embeds at most {limit} tokens per input; shorten it or split it into several inputs", tokens.len()),
                ));
            }
            let last = tokens.last().copied();
            tokens.truncate(limit);
            // An encoder's input ends in its separator ([SEP]), as it was trained.
            if let (true, Some(last), Some(end)) = (state.bundle.config.is_encoder(), last, tokens.last_mut()) {
                *end = last;
            }
        }
        let mut request = GenerateRequest::embedding(tokens);
        // A CPU worker holding another model refuses it (its vectors live in another space).
        request.source = Some(PromptSource { bundle_hash: state.bundle.hash.clone(), input: PromptInput::Text { text: text.clone() } });
        requests.push(request);
    }
    // A fallback model on the CPU worker embeds into another space: such embeddings stay on
    // the GPU, whose failure the client then sees instead of a vector from another model.
    let fallback = state.dispatcher.settings().fallback_model.is_some() && state.dispatcher.gpu_configured();
    let allow_cpu = ask.options.allow_cpu.unwrap_or(true) && !fallback;
    let several = requests.len() > 1;
    let mut submissions = Vec::with_capacity(requests.len());
    for (i, request) in requests.into_iter().enumerate() {
        let prepared = Prepared {
            request,
            stream: false,
            include_usage: false,
            allow_resume: true,
            allow_shrink: false,
            allow_cpu,
            timeout_ms: ask.options.timeout_ms,
            tools: false,
        };
        let mut sub = submission(headers, raw, &prepared)?;
        if several {
            // One key per input: a retry finds each one's stored result.
            sub.idempotency_key = sub.idempotency_key.map(|k| format!("{k}#{i}"));
        }
        submissions.push(sub);
    }
    // A window of inputs in flight, the next submitted as one finishes: a list of thousands
    // fills the workers' batches without filling the queues other clients share.
    let finished: Vec<Completion> = futures_util::stream::iter(submissions)
        .map(|sub| async move {
            let ticket = state.dispatcher.submit(sub)?;
            let request_id = ticket.request_id.clone();
            ticket.finish().await.map_err(|e| {
                let mut err = ApiError::from(e);
                err.message = format!("{} (request {request_id}; GET /v1/requests/{request_id} shows its history)", err.message);
                err
            })
        })
        // Test-only: every input submitted at once.
        .buffered(if headroom_model::test_defect("embed-all-at-once") { usize::MAX } else { IN_FLIGHT })
        .try_collect()
        .await?;
    for c in &finished {
        if c.outcome.embedding.is_none() {
            return Err(ApiError::internal(format!("request {} finished without an embedding", c.outcome.request_id)));
        }
    }
    Ok(finished)
}

/// Where a list's embeddings ran, for the response headers: the worst, a degraded input if
/// there is one.
pub(crate) fn placement(done: &[Completion]) -> headroom_router::Placement {
    done.iter().find(|c| c.outcome.degraded).unwrap_or(&done[0]).placement()
}

/// A `dimensions` other than the model's `width` is refused: only the model's own is served.
pub(crate) fn check_dimensions(dimensions: Option<u32>, width: usize) -> Result<(), ApiError> {
    match dimensions {
        Some(d) if d as usize != width => {
            Err(ApiError::invalid("dimensions", format!("dimensions = {d}: this model's embeddings have {width}; leave dimensions out or send {width}")))
        }
        _ => Ok(()),
    }
}

/// The vector of a finished embedding (checked by [`embed`]).
pub(crate) fn vector(c: &Completion) -> &[f32] {
    c.outcome.embedding.as_deref().unwrap_or_default()
}

/// OpenAI's `encoding_format: base64`: the floats' little-endian bytes.
pub(crate) fn base64_floats(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Checks the OpenAI body's options; `true` for base64.
pub(crate) fn check_openai(body: &EmbeddingRequest, width: usize) -> Result<bool, ApiError> {
    let base64 = match body.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(ApiError::invalid("encoding_format", format!("encoding_format {other:?}: use \"float\" or \"base64\""))),
    };
    check_dimensions(body.dimensions, width)?;
    Ok(base64)
}
