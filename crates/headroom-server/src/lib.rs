//! `headroom-server` owns the HTTP surface: the OpenAI-compatible API, Headroom's status,
//! request and event endpoints, Prometheus metrics, the generated OpenAPI spec and the static
//! web UI. It holds no policy: every decision is the router's.

pub mod embeddings;
pub mod error;
mod exposition;
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

/// What a served model is for: `chat` (chat and completions, and embeddings unless an
/// embedding model is served beside it) or `embedding` (embeddings only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    #[default]
    Chat,
    Embedding,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Chat => "chat",
            Role::Embedding => "embedding",
        }
    }
}

/// A model the service serves: its own workers and dispatcher, on the GPU the served models
/// share.
#[derive(Clone)]
pub struct ServedModel {
    pub dispatcher: Dispatcher,
    pub bundle: Arc<ModelBundle>,
    pub model_id: String,
    pub limits: Limits,
    pub role: Role,
}

/// What the handlers share. The model fields (`dispatcher`, `bundle`, `model_id`, `limits`,
/// `role`) are the first served model's; a handler that names another model works on a copy
/// with that model's ([`AppState::for_model`]).
#[derive(Clone)]
pub struct AppState {
    pub dispatcher: Dispatcher,
    pub bundle: Arc<ModelBundle>,
    /// The id clients use in `model` (the served folder's name).
    pub model_id: String,
    pub limits: Limits,
    pub role: Role,
    /// Every served model, the first one included, in the order they were configured.
    pub models: Arc<Vec<ServedModel>>,
    /// Required as a bearer token when set.
    pub api_key: Option<String>,
    /// Whether `/admin/sim/fault` exists (only with `--gpu sim`).
    pub sim_faults: bool,
    pub created_unix: u64,
}

impl AppState {
    /// The state of the served model `requested` names: its id, `default` (the first model),
    /// either with Ollama's `:tag`. Unknown names are a 404 listing what is served; a name is
    /// only ever compared, never looked up as a path.
    pub fn for_model(self: &Arc<Self>, requested: &str) -> Result<Arc<AppState>, ApiError> {
        let bare = requested.split_once(':').map_or(requested, |(name, _)| name);
        if requested == self.model_id || bare == self.model_id || bare == "default" || requested.is_empty() {
            return Ok(self.clone());
        }
        match self.models.iter().find(|m| m.model_id == requested || m.model_id == bare) {
            Some(m) => Ok(Arc::new(AppState {
                dispatcher: m.dispatcher.clone(),
                bundle: m.bundle.clone(),
                model_id: m.model_id.clone(),
                limits: m.limits.clone(),
                role: m.role,
                ..(**self).clone()
            })),
            None => {
                let mut e = ApiError::not_found(
                    "model_not_found",
                    format!("model {requested:?} is not served here; this server serves {} (see GET /v1/models). Models are configured with `headroom serve --model` or [[models]] in the config file, never per request", self.served_names()),
                );
                e.param = Some("model".into());
                Err(e)
            }
        }
    }

    /// Every served model's state, the first model's first.
    pub fn served(self: &Arc<Self>) -> Vec<Arc<AppState>> {
        let mut all = vec![self.clone()];
        all.extend(self.models.iter().filter(|m| m.model_id != self.model_id).filter_map(|m| self.for_model(&m.model_id).ok()));
        all
    }

    /// The served models' ids, quoted and listed: `"a", "b"`.
    pub fn served_names(&self) -> String {
        let names: Vec<String> = if self.models.is_empty() { vec![format!("{:?}", self.model_id)] } else { self.models.iter().map(|m| format!("{:?}", m.model_id)).collect() };
        names.join(", ")
    }

    /// Refuses a request of the wrong kind for this model: chat or completions to an embedding
    /// model; embeddings to a chat model when an embedding model is served beside it.
    pub fn check_role(&self, wants: Role) -> Result<(), ApiError> {
        let embedder = self.models.iter().find(|m| m.role == Role::Embedding);
        match (wants, self.role) {
            (Role::Chat, Role::Embedding) => Err(ApiError::invalid(
                "model",
                format!("model {:?} is an embedding model: it answers POST /v1/embeddings (and Ollama's /api/embed); send chat and completions to a chat model ({})", self.model_id, self.names_with(Role::Chat)),
            )),
            (Role::Embedding, Role::Chat) if embedder.is_some() => Err(ApiError::invalid(
                "model",
                format!("model {:?} is a chat model; embeddings are served by {} here", self.model_id, self.names_with(Role::Embedding)),
            )),
            _ => Ok(()),
        }
    }

    fn names_with(&self, role: Role) -> String {
        let names: Vec<String> = self.models.iter().filter(|m| m.role == role).map(|m| format!("{:?}", m.model_id)).collect();
        if names.is_empty() { "none is served".into() } else { names.join(", ") }
    }

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
