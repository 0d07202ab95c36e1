//! The durable request journal (SQLite, WAL, synchronous commits).
//!
//! A request is written here *before* the client is told it was accepted, and every transition
//! after that is appended, so a crash of the whole service (`kill -9`, power loss) loses nothing:
//! on start, [`Journal::recover`] lists every accepted, unfinished request and says whether to run
//! it again or to end it with a resumable error. Idempotency keys are stored with a hash of the
//! request body; tool calls are recorded when delivered so a replay never delivers one twice.

use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use headroom_worker::{Device, FailureKind};
use serde::{Deserialize, Serialize};

use crate::Lane;

/// Bumped when the schema changes; an older file is migrated or refused with a clear message.
const SCHEMA_VERSION: i64 = 1;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal database: {0} (if the file is damaged, move it away and restart: a new one is created)")]
    Db(#[from] rusqlite::Error),
    #[error("idempotency key {key:?} was first used with a different request body; use a new key for a new request")]
    KeyConflict { key: String },
    #[error("no request {0} in the journal")]
    NotFound(String),
    #[error("journal file {path} has schema version {found}, this Headroom understands {SCHEMA_VERSION}; upgrade Headroom or move the file away")]
    Schema { path: String, found: i64 },
    #[error("journal record: {0}")]
    Encoding(#[from] serde_json::Error),
}

pub type JournalResult<T> = Result<T, JournalError>;

/// Where a request stands. Terminal states never change again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestState {
    Accepted,
    Queued,
    Running,
    Completed,
    Failed,
    Cancelled,
    Refused,
}

impl RequestState {
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Cancelled | Self::Refused)
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Refused => "refused",
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "completed" => Self::Completed,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            "refused" => Self::Refused,
            _ => Self::Accepted,
        }
    }
}

/// One step in a request's life, as appended to the journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "transition", rename_all = "snake_case")]
pub enum Transition {
    /// Waiting in a lane's queue (`device` is the lane: `gpu` or `cpu`).
    Queued { device: Lane },
    Running { device: Device, attempt: u32 },
    /// An attempt failed; the request may still be replayed or resumed.
    AttemptFailed {
        device: Device,
        #[serde(deserialize_with = "failure_kind_or_unknown")]
        kind: FailureKind,
        detail: String,
    },
    Replayed { to: Device, attempt: u32 },
    Resumed { to: Device, attempt: u32, after_tokens: u32 },
    Completed { device: Device, result: serde_json::Value },
    /// The request ended without a result. `resumable`: the client may retry or resume it.
    Failed {
        #[serde(deserialize_with = "end_cause_or_unknown")]
        kind: EndCause,
        detail: String,
        resumable: bool,
    },
    Cancelled { reason: String },
    Refused { reason: String },
}

/// Why a request ended without a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndCause {
    /// No queue could take it (after a failover that the request did not allow, for one).
    Capacity,
    /// A worker failed it and no other could take it.
    Worker,
    /// Tokens had been delivered and the request did not allow resuming elsewhere.
    Interrupted,
    /// The request itself is wrong.
    Invalid,
    /// Headroom itself (a restart that could not re-run it, a journal that failed).
    Internal,
}

impl std::fmt::Display for EndCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = serde_json::to_value(self).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        f.write_str(&name)
    }
}

/// Journals written before these kinds were typed hold other words (`failover`): read them as
/// unknown rather than refuse the whole history.
fn failure_kind_or_unknown<'de, D: serde::Deserializer<'de>>(d: D) -> Result<FailureKind, D::Error> {
    let word = String::deserialize(d)?;
    Ok(serde_json::from_value(serde_json::Value::String(word)).unwrap_or(FailureKind::Internal))
}

fn end_cause_or_unknown<'de, D: serde::Deserializer<'de>>(d: D) -> Result<EndCause, D::Error> {
    let word = String::deserialize(d)?;
    Ok(serde_json::from_value(serde_json::Value::String(word)).unwrap_or(EndCause::Internal))
}

impl Transition {
    fn state(&self) -> RequestState {
        match self {
            Self::Queued { .. } => RequestState::Queued,
            Self::Running { .. } | Self::AttemptFailed { .. } | Self::Replayed { .. } | Self::Resumed { .. } => {
                RequestState::Running
            }
            Self::Completed { .. } => RequestState::Completed,
            Self::Failed { .. } => RequestState::Failed,
            Self::Cancelled { .. } => RequestState::Cancelled,
            Self::Refused { .. } => RequestState::Refused,
        }
    }

    /// Where the request is now: a lane while it waits, a device while it runs or once done.
    fn device(&self) -> Option<String> {
        match self {
            Self::Queued { device } => Some(device.to_string()),
            Self::Running { device, .. } | Self::Completed { device, .. } => Some(device.label()),
            Self::Replayed { to, .. } | Self::Resumed { to, .. } => Some(to.label()),
            _ => None,
        }
    }

    fn attempt(&self) -> Option<u32> {
        match self {
            Self::Running { attempt, .. } | Self::Replayed { attempt, .. } | Self::Resumed { attempt, .. } => Some(*attempt),
            _ => None,
        }
    }
}

/// What the router accepts: everything needed to run the request again after a restart.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NewRequest {
    pub id: String,
    pub idempotency_key: Option<String>,
    /// A hash of the client's request body: the same key with another body is a conflict.
    pub body_hash: String,
    /// The request as the router runs it (JSON), for replay after a restart.
    pub body: serde_json::Value,
    pub stream: bool,
    pub allow_resume: bool,
}

/// A journaled request: what was accepted, and where it stands now.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    #[serde(flatten)]
    pub request: NewRequest,
    pub state: RequestState,
    pub device: Option<String>,
    pub attempt: u32,
    /// Tokens the client has been sent (streams); a stream with any is no longer replayable
    /// from the start.
    pub delivered_tokens: u32,
    pub accepted_unix_ms: u64,
    pub updated_unix_ms: u64,
    pub result: Option<serde_json::Value>,
    pub error: Option<String>,
}

impl RequestRecord {
    /// Whether the request can run again from the start without the client seeing anything twice.
    pub fn replayable_from_start(&self, tool_calls_delivered: usize) -> bool {
        tool_calls_delivered == 0 && (!self.request.stream || self.delivered_tokens == 0)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TransitionRecord {
    pub seq: i64,
    pub at_unix_ms: u64,
    pub state: RequestState,
    pub transition: Transition,
}

/// The outcome of [`Journal::accept`].
#[derive(Debug, Clone, PartialEq)]
pub enum Accepted {
    /// Newly written; the caller runs it.
    New,
    /// The idempotency key was seen before with the same body: return this request's stored
    /// result, or attach to it while it runs.
    Existing(RequestRecord),
}

/// What to do with an unfinished request found at start-up.
#[derive(Debug, Clone, PartialEq)]
pub enum Recovery {
    /// Nothing irreversible was delivered: run it again (same id, next attempt); its client can
    /// collect the result by id or by retrying with its idempotency key.
    Rerun(RequestRecord),
    /// Ended as failed with a resumable error (what was delivered stays delivered).
    MarkedFailed { record: RequestRecord, reason: String },
}

pub struct Journal {
    conn: Mutex<Connection>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Journal {
    /// Opens (or creates) the journal at `path`.
    pub fn open(path: &Path) -> JournalResult<Self> {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let conn = Connection::open(path)?;
        Self::init(conn, &path.display().to_string())
    }

    /// A journal that lives only as long as the process (tests, `--no-journal`).
    pub fn in_memory() -> JournalResult<Self> {
        Self::init(Connection::open_in_memory()?, ":memory:")
    }

    fn init(conn: Connection, path: &str) -> JournalResult<Self> {
        // WAL: readers never block the writer; FULL: a commit is on disk before we answer.
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version != 0 && version != SCHEMA_VERSION {
            return Err(JournalError::Schema { path: path.to_string(), found: version });
        }
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS requests (
                 id TEXT PRIMARY KEY,
                 idempotency_key TEXT UNIQUE,
                 body_hash TEXT NOT NULL,
                 body TEXT NOT NULL,
                 stream INTEGER NOT NULL,
                 allow_resume INTEGER NOT NULL,
                 state TEXT NOT NULL,
                 device TEXT,
                 attempt INTEGER NOT NULL DEFAULT 0,
                 delivered_tokens INTEGER NOT NULL DEFAULT 0,
                 accepted_ms INTEGER NOT NULL,
                 updated_ms INTEGER NOT NULL,
                 result TEXT,
                 error TEXT
             );
             CREATE INDEX IF NOT EXISTS requests_state ON requests(state);
             CREATE TABLE IF NOT EXISTS transitions (
                 request_id TEXT NOT NULL REFERENCES requests(id),
                 seq INTEGER NOT NULL,
                 at_ms INTEGER NOT NULL,
                 state TEXT NOT NULL,
                 detail TEXT NOT NULL,
                 PRIMARY KEY (request_id, seq)
             );
             CREATE TABLE IF NOT EXISTS tool_calls (
                 request_id TEXT NOT NULL REFERENCES requests(id),
                 call_id TEXT NOT NULL,
                 name TEXT NOT NULL,
                 arguments TEXT NOT NULL,
                 delivered_ms INTEGER NOT NULL,
                 PRIMARY KEY (request_id, call_id)
             );",
        )?;
        conn.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        Ok(Self { conn: Mutex::new(conn) })
    }

    /// Makes every later write fail the way a full or read-only disk does (SQLite's own
    /// `query_only` refusal), so tests can check that no failed write goes unnoticed.
    #[doc(hidden)]
    pub fn refuse_writes_for_test(&self) {
        let _ = self.conn().pragma_update(None, "query_only", true);
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes a new request durably, or finds the earlier one with the same idempotency key.
    pub fn accept(&self, request: &NewRequest) -> JournalResult<Accepted> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if let Some(key) = &request.idempotency_key {
            let existing: Option<String> = tx
                .query_row("SELECT id FROM requests WHERE idempotency_key = ?1", [key], |r| r.get(0))
                .optional()?;
            if let Some(id) = existing {
                let record = read_record(&tx, &id)?;
                if record.request.body_hash != request.body_hash {
                    return Err(JournalError::KeyConflict { key: key.clone() });
                }
                return Ok(Accepted::Existing(record));
            }
        }
        let now = now_ms() as i64;
        tx.execute(
            "INSERT INTO requests (id, idempotency_key, body_hash, body, stream, allow_resume, state, accepted_ms, updated_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'accepted', ?7, ?7)",
            params![
                request.id,
                request.idempotency_key,
                request.body_hash,
                serde_json::to_string(&request.body)?,
                request.stream,
                request.allow_resume,
                now
            ],
        )?;
        tx.execute(
            "INSERT INTO transitions (request_id, seq, at_ms, state, detail) VALUES (?1, 0, ?2, 'accepted', '{}')",
            params![request.id, now],
        )?;
        tx.commit()?;
        Ok(Accepted::New)
    }

    /// Appends a transition. A transition on a request that already ended is ignored (and
    /// returns false): a late event from a dead worker must not reopen it.
    pub fn record(&self, id: &str, transition: &Transition) -> JournalResult<bool> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let current: Option<String> = tx
            .query_row("SELECT state FROM requests WHERE id = ?1", [id], |r| r.get(0))
            .optional()?;
        let Some(current) = current else {
            return Err(JournalError::NotFound(id.to_string()));
        };
        if RequestState::parse(&current).is_terminal() {
            return Ok(false);
        }
        let state = transition.state();
        let now = now_ms() as i64;
        let seq: i64 = tx.query_row(
            "SELECT COALESCE(MAX(seq), -1) + 1 FROM transitions WHERE request_id = ?1",
            [id],
            |r| r.get(0),
        )?;
        tx.execute(
            "INSERT INTO transitions (request_id, seq, at_ms, state, detail) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![id, seq, now, state.as_str(), serde_json::to_string(transition)?],
        )?;
        let (result, error) = match transition {
            Transition::Completed { result, .. } => (Some(serde_json::to_string(result)?), None),
            Transition::Failed { kind, detail, .. } => (None, Some(format!("{kind}: {detail}"))),
            Transition::Cancelled { reason } | Transition::Refused { reason } => (None, Some(reason.clone())),
            _ => (None, None),
        };
        tx.execute(
            "UPDATE requests SET state = ?2, updated_ms = ?3,
                 device = COALESCE(?4, device), attempt = COALESCE(?5, attempt),
                 result = COALESCE(?6, result), error = COALESCE(?7, error)
             WHERE id = ?1",
            params![id, state.as_str(), now, transition.device(), transition.attempt(), result, error],
        )?;
        tx.commit()?;
        Ok(true)
    }

    /// Notes how many tokens a stream has sent its client. Written when the first one goes out
    /// (the point after which a replay from the start would show the client text twice) and then
    /// now and again; it only ever grows.
    pub fn record_delivered(&self, id: &str, delivered_tokens: u32) -> JournalResult<()> {
        self.conn().execute(
            "UPDATE requests SET delivered_tokens = MAX(delivered_tokens, ?2), updated_ms = ?3 WHERE id = ?1",
            params![id, delivered_tokens, now_ms() as i64],
        )?;
        Ok(())
    }

    /// Records a tool call as delivered. Returns false when this call was already delivered:
    /// the caller must not deliver it again.
    pub fn record_tool_call(&self, id: &str, call_id: &str, name: &str, arguments: &str) -> JournalResult<bool> {
        let inserted = self.conn().execute(
            "INSERT OR IGNORE INTO tool_calls (request_id, call_id, name, arguments, delivered_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![id, call_id, name, arguments, now_ms() as i64],
        )?;
        Ok(inserted == 1)
    }

    pub fn tool_calls_delivered(&self, id: &str) -> JournalResult<usize> {
        let n: i64 = self
            .conn()
            .query_row("SELECT COUNT(*) FROM tool_calls WHERE request_id = ?1", [id], |r| r.get(0))?;
        Ok(n as usize)
    }

    pub fn get(&self, id: &str) -> JournalResult<RequestRecord> {
        read_record(&self.conn(), id)
    }

    pub fn find_by_key(&self, key: &str) -> JournalResult<Option<RequestRecord>> {
        let conn = self.conn();
        let id: Option<String> = conn
            .query_row("SELECT id FROM requests WHERE idempotency_key = ?1", [key], |r| r.get(0))
            .optional()?;
        id.map(|id| read_record(&conn, &id)).transpose()
    }

    pub fn transitions(&self, id: &str) -> JournalResult<Vec<TransitionRecord>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT seq, at_ms, state, detail FROM transitions WHERE request_id = ?1 AND seq > 0 ORDER BY seq",
        )?;
        let rows = stmt.query_map([id], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, String>(2)?, r.get::<_, String>(3)?))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (seq, at, state, detail) = row?;
            out.push(TransitionRecord {
                seq,
                at_unix_ms: at as u64,
                state: RequestState::parse(&state),
                transition: serde_json::from_str(&detail)?,
            });
        }
        Ok(out)
    }

    /// Requests in each state (for status and metrics).
    pub fn counts(&self) -> JournalResult<Vec<(RequestState, u64)>> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT state, COUNT(*) FROM requests GROUP BY state ORDER BY state")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        rows.map(|r| r.map(|(s, n)| (RequestState::parse(&s), n as u64)).map_err(Into::into))
            .collect()
    }

    /// At start-up: every accepted, unfinished request, each either to be run again or marked
    /// failed with a resumable error (recorded here). None is left unfinished and none vanishes.
    pub fn recover(&self) -> JournalResult<Vec<Recovery>> {
        let ids: Vec<String> = {
            let conn = self.conn();
            let mut stmt = conn.prepare(
                "SELECT id FROM requests WHERE state IN ('accepted', 'queued', 'running') ORDER BY accepted_ms, id",
            )?;
            let rows = stmt.query_map([], |r| r.get(0))?;
            rows.collect::<Result<_, _>>()?
        };
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let record = self.get(&id)?;
            let tools = self.tool_calls_delivered(&id)?;
            if record.replayable_from_start(tools) {
                out.push(Recovery::Rerun(record));
            } else {
                let reason = if tools > 0 {
                    format!("the service restarted after {tools} tool call(s) were delivered; not regenerated so they are not repeated")
                } else {
                    format!(
                        "the service restarted after {} streamed token(s); resume by sending them back as the prompt, or retry",
                        record.delivered_tokens
                    )
                };
                self.record(&id, &Transition::Failed { kind: EndCause::Interrupted, detail: reason.clone(), resumable: true })?;
                out.push(Recovery::MarkedFailed { record: self.get(&id)?, reason });
            }
        }
        Ok(out)
    }
}

fn read_record(conn: &Connection, id: &str) -> JournalResult<RequestRecord> {
    let row = conn
        .query_row(
            "SELECT id, idempotency_key, body_hash, body, stream, allow_resume, state, device, attempt,
                    delivered_tokens, accepted_ms, updated_ms, result, error
             FROM requests WHERE id = ?1",
            [id],
            |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, Option<String>>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, bool>(4)?,
                    r.get::<_, bool>(5)?,
                    r.get::<_, String>(6)?,
                    r.get::<_, Option<String>>(7)?,
                    r.get::<_, i64>(8)?,
                    r.get::<_, i64>(9)?,
                    r.get::<_, i64>(10)?,
                    r.get::<_, i64>(11)?,
                    r.get::<_, Option<String>>(12)?,
                    r.get::<_, Option<String>>(13)?,
                ))
            },
        )
        .optional()?
        .ok_or_else(|| JournalError::NotFound(id.to_string()))?;
    let (id, key, body_hash, body, stream, allow_resume, state, device, attempt, delivered, accepted, updated, result, error) = row;
    Ok(RequestRecord {
        request: NewRequest { id, idempotency_key: key, body_hash, body: serde_json::from_str(&body)?, stream, allow_resume },
        state: RequestState::parse(&state),
        device,
        attempt: attempt as u32,
        delivered_tokens: delivered as u32,
        accepted_unix_ms: accepted as u64,
        updated_unix_ms: updated as u64,
        result: result.map(|r| serde_json::from_str(&r)).transpose()?,
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn new(id: &str, key: Option<&str>, body: &str, stream: bool) -> NewRequest {
        NewRequest {
            id: id.into(),
            idempotency_key: key.map(str::to_string),
            body_hash: format!("hash-of-{body}"),
            body: json!({ "prompt": body }),
            stream,
            allow_resume: false,
        }
    }

    #[test]
    fn transitions_written_before_their_kinds_were_typed_still_read() {
        let old = r#"{"transition":"attempt_failed","device":"sim","kind":"failover","detail":"x"}"#;
        let t: Transition = serde_json::from_str(old).unwrap();
        assert_eq!(t, Transition::AttemptFailed { device: Device::Sim, kind: FailureKind::Internal, detail: "x".into() });
        let old = r#"{"transition":"failed","kind":"capacity","detail":"y","resumable":true}"#;
        let t: Transition = serde_json::from_str(old).unwrap();
        assert_eq!(t, Transition::Failed { kind: EndCause::Capacity, detail: "y".into(), resumable: true });
        let old = r#"{"transition":"queued","device":"cpu"}"#;
        assert_eq!(serde_json::from_str::<Transition>(old).unwrap(), Transition::Queued { device: Lane::Cpu });
    }

    #[test]
    fn a_request_walks_its_transitions_and_ends_once() {
        let j = Journal::in_memory().unwrap();
        assert_eq!(j.accept(&new("r1", None, "a", false)).unwrap(), Accepted::New);
        assert_eq!(j.get("r1").unwrap().state, RequestState::Accepted);
        j.record("r1", &Transition::Queued { device: Lane::Gpu }).unwrap();
        j.record("r1", &Transition::Running { device: Device::Sim, attempt: 1 }).unwrap();
        j.record("r1", &Transition::AttemptFailed { device: Device::Sim, kind: FailureKind::Oom, detail: "x".into() }).unwrap();
        j.record("r1", &Transition::Replayed { to: Device::Cpu, attempt: 2 }).unwrap();
        assert!(j.record("r1", &Transition::Completed { device: Device::Cpu, result: json!({"text": "hi"}) }).unwrap());
        let r = j.get("r1").unwrap();
        assert_eq!((r.state, r.device.as_deref(), r.attempt), (RequestState::Completed, Some("cpu"), 2));
        assert_eq!(r.result, Some(json!({"text": "hi"})));
        // A late event from a dead worker does not reopen it.
        assert!(!j.record("r1", &Transition::Failed { kind: EndCause::Worker, detail: "late".into(), resumable: true }).unwrap());
        assert_eq!(j.get("r1").unwrap().state, RequestState::Completed);
        let steps: Vec<RequestState> = j.transitions("r1").unwrap().iter().map(|t| t.state).collect();
        assert_eq!(steps.len(), 5);
        assert_eq!(steps.last(), Some(&RequestState::Completed));
        assert!(matches!(j.record("nope", &Transition::Cancelled { reason: "x".into() }), Err(JournalError::NotFound(_))));
    }

    #[test]
    fn idempotency_keys_return_the_first_request_or_conflict() {
        let j = Journal::in_memory().unwrap();
        assert_eq!(j.accept(&new("r1", Some("k"), "a", false)).unwrap(), Accepted::New);
        j.record("r1", &Transition::Completed { device: Device::Cpu, result: json!(1) }).unwrap();
        match j.accept(&new("r2", Some("k"), "a", false)).unwrap() {
            Accepted::Existing(r) => assert_eq!((r.request.id.as_str(), r.result), ("r1", Some(json!(1)))),
            other => panic!("{other:?}"),
        }
        let err = j.accept(&new("r3", Some("k"), "b", false)).unwrap_err();
        assert!(matches!(err, JournalError::KeyConflict { .. }));
        assert!(err.to_string().contains("different request body"));
        assert!(matches!(j.get("r2"), Err(JournalError::NotFound(_))), "the retry wrote nothing new");
        assert_eq!(j.find_by_key("k").unwrap().unwrap().request.id, "r1");
    }

    #[test]
    fn tool_calls_are_delivered_at_most_once() {
        let j = Journal::in_memory().unwrap();
        j.accept(&new("r1", None, "a", false)).unwrap();
        assert!(j.record_tool_call("r1", "call_1", "get_weather", "{}").unwrap());
        assert!(!j.record_tool_call("r1", "call_1", "get_weather", "{}").unwrap());
        assert_eq!(j.tool_calls_delivered("r1").unwrap(), 1);
    }

    #[test]
    fn recovery_after_a_crash_reruns_or_fails_every_unfinished_request() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.sqlite");
        {
            let j = Journal::open(&path).unwrap();
            j.accept(&new("done", None, "a", false)).unwrap();
            j.record("done", &Transition::Completed { device: Device::Cpu, result: json!(0) }).unwrap();
            j.accept(&new("queued", None, "b", false)).unwrap();
            j.record("queued", &Transition::Queued { device: Lane::Gpu }).unwrap();
            j.accept(&new("stream-fresh", None, "c", true)).unwrap();
            j.record("stream-fresh", &Transition::Running { device: Device::Sim, attempt: 1 }).unwrap();
            j.accept(&new("stream-sent", None, "d", true)).unwrap();
            j.record("stream-sent", &Transition::Running { device: Device::Sim, attempt: 1 }).unwrap();
            j.record_delivered("stream-sent", 5).unwrap();
            j.accept(&new("tool", None, "e", false)).unwrap();
            j.record_tool_call("tool", "call_1", "send_email", "{}").unwrap();
            // Dropped without any shutdown: as after kill -9, only committed data remains.
        }
        let j = Journal::open(&path).unwrap();
        let recovered = j.recover().unwrap();
        let rerun: Vec<&str> = recovered
            .iter()
            .filter_map(|r| match r {
                Recovery::Rerun(rec) => Some(rec.request.id.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(rerun, ["queued", "stream-fresh"]);
        let failed: Vec<&str> = recovered
            .iter()
            .filter_map(|r| match r {
                Recovery::MarkedFailed { record, .. } => Some(record.request.id.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(failed, ["stream-sent", "tool"]);
        let sent = j.get("stream-sent").unwrap();
        assert_eq!(sent.state, RequestState::Failed);
        assert!(sent.error.unwrap().contains("5 streamed token"));
        assert!(j.get("tool").unwrap().error.unwrap().contains("not regenerated"));
        assert_eq!(j.get("done").unwrap().state, RequestState::Completed);
        // Recovering again finds only what is still to be re-run.
        assert_eq!(j.recover().unwrap().len(), 2);
    }

    #[test]
    fn a_newer_schema_is_refused_with_a_clear_message() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.sqlite");
        Connection::open(&path).unwrap().pragma_update(None, "user_version", 99).unwrap();
        let err = Journal::open(&path).err().unwrap();
        assert!(err.to_string().contains("schema version 99"), "{err}");
    }
}
