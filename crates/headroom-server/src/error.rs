//! OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`, with the status
//! the error deserves and, for capacity errors, `Retry-After`.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use headroom_router::{JournalError, SettingsError, SubmitError};
use serde::Serialize;
use utoipa::ToSchema;

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    pub message: String,
    pub retry_after_s: Option<u64>,
    pub estimated_delay_ms: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> Self {
        Self { status, kind, code, param: None, message: message.into(), retry_after_s: None, estimated_delay_ms: None }
    }

    /// A 400 for a bad field; `param` names it.
    pub fn invalid(param: impl Into<Option<&'static str>>, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, message);
        e.param = param.into().map(str::to_string);
        e
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", Some(code), message)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "missing or wrong API key: send `Authorization: Bearer $HEADROOM_API_KEY`",
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, message)
    }

    pub fn unavailable(message: impl Into<String>, retry_after_s: u64) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("unavailable"), message);
        e.retry_after_s = Some(retry_after_s);
        e
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail { message: self.message.clone(), kind: self.kind.to_string(), param: self.param.clone(), code: self.code.map(str::to_string) },
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Invalid(m) => Self::invalid(None, m),
            SubmitError::Conflict(m) => Self::new(StatusCode::CONFLICT, "invalid_request_error", Some("idempotency_key_reused"), m),
            SubmitError::Capacity { reason, retry_after_s, estimated_delay_ms } => {
                let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "capacity_error", Some("capacity_exceeded"), reason);
                e.retry_after_s = Some(retry_after_s.unwrap_or(1).max(1));
                e.estimated_delay_ms = estimated_delay_ms;
                e
            }
            SubmitError::Cancelled => Self::new(StatusCode::CONFLICT, "invalid_request_error", Some("request_cancelled"), "the request was cancelled"),
            SubmitError::Failed { reason, resumable } => {
                let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some(if resumable { "resumable" } else { "failed" }), reason);
                e.retry_after_s = resumable.then_some(1);
                e
            }
            SubmitError::Journal(e) => Self::from(e),
        }
    }
}

impl From<SettingsError> for ApiError {
    fn from(e: SettingsError) -> Self {
        match e {
            SettingsError::Invalid(m) => Self::invalid(None, m),
            SettingsError::NotApplied(m) => Self::new(StatusCode::CONFLICT, "invalid_request_error", Some("settings_not_applied"), m),
            SettingsError::NotSaved(m) => Self::internal(m),
        }
    }
}

impl From<JournalError> for ApiError {
    fn from(e: JournalError) -> Self {
        match e {
            JournalError::NotFound(id) => Self::not_found("request_not_found", format!("no request {id:?} in the journal")),
            e => Self::internal(format!("request journal: {e}")),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        let headers = response.headers_mut();
        if let Some(s) = self.retry_after_s {
            headers.insert("retry-after", HeaderValue::from(s));
        }
        if let Some(d) = self.estimated_delay_ms {
            headers.insert("x-headroom-estimated-delay-ms", HeaderValue::from(d));
        }
        response
    }
}
