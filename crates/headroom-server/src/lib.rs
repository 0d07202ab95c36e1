//! `headroom-server` owns the HTTP surface: the OpenAI-compatible API, Headroom's status,
//! request and event endpoints, Prometheus metrics, the generated OpenAPI spec and the static
//! web UI. It holds no policy: every decision is the router's.

pub mod embeddings;
pub mod error;
pub mod ollama;
pub mod openai;
pub mod sse;
mod routes;

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use headroom_model::ModelBundle;
use headroom_router::Dispatcher;
use serde::{Deserialize, Serialize};

pub use error::ApiError;
pub use openai::Limits;
pub use routes::ApiDoc;

/// The `[server]` table of the config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to bind. Anything but a loopback address needs `HEADROOM_API_KEY`.
    pub host: String,
    pub port: u16,
    /// Largest request body accepted, in bytes.
    pub body_limit_bytes: usize,
    /// Browser origins allowed to call the API besides the server's own pages (the desktop
    /// app's origins are always allowed).
    pub cors_origins: Vec<String>,
    /// max_tokens for a request that sends none (capped by the context left).
    pub default_max_tokens: usize,
    /// Where the request journal lives; default `$XDG_DATA_HOME/headroom`.
    pub data_dir: Option<PathBuf>,
    /// A smaller model folder for the CPU worker (responses then name it).
    pub cpu_fallback_model: Option<PathBuf>,
    /// The built web UI (`ui/dist`); default: next to the binary's workspace, if built.
    pub ui_dir: Option<PathBuf>,
    /// On shutdown, how long running requests may finish before they are left to the journal.
    pub shutdown_grace_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            body_limit_bytes: 4 << 20,
            cors_origins: Vec::new(),
            default_max_tokens: 256,
            data_dir: None,
            cpu_fallback_model: None,
            ui_dir: None,
            shutdown_grace_ms: 10_000,
        }
    }
}

impl ServerConfig {
    pub fn from_toml(text: &str) -> headroom_router::Result<Self> {
        headroom_router::config_table(text, "server")
    }

    /// Whether `host` is only reachable from this machine.
    pub fn is_loopback(&self) -> bool {
        self.host == "localhost" || self.host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
    }
}

/// The desktop app's web view origins (Tauri 2 on Linux/macOS and on Windows).
pub const APP_ORIGINS: [&str; 3] = ["tauri://localhost", "http://tauri.localhost", "https://tauri.localhost"];

/// What the handlers share.
pub struct AppState {
    pub dispatcher: Dispatcher,
    pub bundle: Arc<ModelBundle>,
    /// The id clients use in `model` (the served folder's name).
    pub model_id: String,
    pub limits: Limits,
    /// Required as a bearer token when set.
    pub api_key: Option<String>,
    /// Whether `/admin/sim/fault` exists (only with `--gpu sim`).
    pub sim_faults: bool,
    pub created_unix: u64,
}

impl AppState {
    /// The limits a request is checked against now: without a GPU the CPU worker's context
    /// limit from settings applies.
    pub fn limits_now(&self) -> Limits {
        let mut limits = self.limits.clone();
        if !self.dispatcher.gpu_configured() {
            limits.context_tokens = limits.context_tokens.min(self.dispatcher.settings().cpu_max_context_tokens as usize);
        }
        limits
    }
}

/// The whole HTTP app.
pub fn app(state: Arc<AppState>, config: &ServerConfig) -> axum::Router {
    let mut origins: Vec<HeaderValue> = APP_ORIGINS.iter().map(|o| HeaderValue::from_static(o)).collect();
    origins.extend(config.cors_origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()));
    let cors = tower_http::cors::CorsLayer::new()
        .allow_origin(origins)
        .allow_methods([Method::GET, Method::POST, Method::PATCH])
        .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE, "idempotency-key".parse().unwrap(), "x-headroom-timeout-ms".parse().unwrap()])
        .expose_headers(routes::EXPOSED_HEADERS.map(|h| h.parse().unwrap()));
    let ui_dir = config.ui_dir.clone().filter(|d| d.join("index.html").is_file());
    routes::router(state.clone(), ui_dir)
        .layer(axum::middleware::from_fn_with_state(state, authorize))
        .layer(axum::extract::DefaultBodyLimit::max(config.body_limit_bytes))
        .layer(cors)
        .layer(axum::middleware::from_fn(request_id))
}

/// Every response carries `X-Request-Id`: the request's journal id where there is one,
/// otherwise a fresh id for this HTTP exchange.
async fn request_id(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    if !response.headers().contains_key(routes::REQUEST_ID) {
        if let Ok(v) = HeaderValue::from_str(&routes::new_request_id()) {
            response.headers_mut().insert(routes::REQUEST_ID, v);
        }
    }
    response
}

/// With an API key configured, everything but the liveness and readiness probes needs it.
async fn authorize(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(key) = &state.api_key else { return next.run(request).await };
    let path = request.uri().path();
    if path == "/healthz" || path == "/readyz" || request.method() == Method::OPTIONS {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(presented.as_bytes(), key.as_bytes()) {
        next.run(request).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_config_reads_its_table_and_knows_loopback() {
        let c = ServerConfig::from_toml("[server]\nport = 9000\nhost = \"0.0.0.0\"\n").unwrap();
        assert_eq!(c.port, 9000);
        assert!(!c.is_loopback());
        assert!(ServerConfig::default().is_loopback());
        assert!(ServerConfig::from_toml("[server]\nprot = 1\n").unwrap_err().to_string().contains("prot"));
    }

    #[test]
    fn keys_compare_whole() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"ab", b"abc"));
    }
}
