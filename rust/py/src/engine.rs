//! `tokenspeed._core.Engine`: the serving engine inside a Python process, for the offline API
//! (`tokenspeed.LLM`, `tokenspeed.AsyncLLM`). It runs the server's own request pipeline —
//! `validate/` (the completions and chat checks), `generate::start_choices` (render, tokenize,
//! prompt budget, grammar compile, submit), the engine threads and their workers — with no HTTP
//! listener. Outputs of every request go to one queue that Python drains with `recv` (the GIL
//! released while it waits); an event is a JSON object (see `chunk_event`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use serde_json::{json, Map, Value};
use tokenspeed_server::error::RequestError;
use tokenspeed_server::frontend::Frontend;
use tokenspeed_server::generate::{self, Chunk, GenerationSpec, TokenLogprob};
use tokenspeed_server::http::error::ApiError;
use tokenspeed_server::http::pooling::{
    self as http_pooling, ClassifyRequest, EmbeddingRequest, ScoreRequest,
};
use tokenspeed_server::http::protocol::{
    check_extra_fields, ChatCompletionRequest, CompletionRequest,
};
use tokenspeed_server::validate;
use tokenspeed_server::validate::pooling::check_server_kind;

/// One engine per process: its workers, KV pool and logging are the process's.
static ENGINE_RUNNING: AtomicBool = AtomicBool::new(false);

/// How often a waiting `recv` wakes to let Python handle Ctrl-C.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

type Tasks = Arc<Mutex<HashMap<String, tokio::task::AbortHandle>>>;

#[pyclass(module = "tokenspeed._core")]
pub struct Engine {
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    frontend: Arc<Frontend>,
    events: mpsc::Sender<Value>,
    outputs: Mutex<mpsc::Receiver<Value>>,
    /// Requests in flight by the caller's id: aborting one drops its generations, which
    /// aborts them in the engine (`generate::AbortGuard`).
    tasks: Tasks,
    closed: AtomicBool,
}

/// A request, checked: one spec per prompt, `n` samples each, and whether the caller asked
/// for the sampled tokens' logprobs.
struct Checked {
    specs: Vec<GenerationSpec>,
    n: usize,
    logprobs: bool,
}

#[pymethods]
impl Engine {
    /// Starts the engine threads over `channels` (as `serve` does, from the same config) and
    /// runs the warm-up generation; refuses a second engine in this process.
    #[staticmethod]
    #[pyo3(signature = (config_json, channels, log_level = "info"))]
    fn start(
        py: Python<'_>,
        config_json: &str,
        channels: &Bound<'_, PyAny>,
        log_level: &str,
    ) -> PyResult<Self> {
        if ENGINE_RUNNING.swap(true, Ordering::SeqCst) {
            return Err(PyRuntimeError::new_err(
                "a TokenSpeed engine is already running in this process; shut it down first \
                 (llm.shutdown(), or use it as a context manager)",
            ));
        }
        let started = Self::start_inner(py, config_json, channels, log_level);
        if started.is_err() {
            ENGINE_RUNNING.store(false, Ordering::SeqCst);
        }
        started
    }

    /// Validates a request as `/v1/completions` (`kind="completion"`) or
    /// `/v1/chat/completions` (`kind="chat"`) validate their bodies (a ValueError naming the
    /// field), then starts it under `request_id`. With `stream`, every chunk is an event (its
    /// text and tokens new since the last); without, each choice's one event at its end.
    #[pyo3(signature = (request_id, kind, body, stream = false))]
    fn submit(&self, request_id: String, kind: &str, body: &str, stream: bool) -> PyResult<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(PyRuntimeError::new_err("the engine was shut down"));
        }
        if !self.frontend.engine.is_healthy() {
            return Err(PyRuntimeError::new_err(
                "the engine cannot serve: its worker group is down",
            ));
        }
        let pooling = PoolingBody::parse(kind, body).map_err(value_error)?;
        let is_embedding = self.frontend.config.is_embedding;
        check_server_kind(
            is_embedding,
            pooling.is_some(),
            &format!("a {kind:?} request"),
        )
        .map_err(value_error)?;
        if let Some(pooling) = pooling {
            return self.submit_pooling(request_id, pooling);
        }
        let checked = self.check(kind, body).map_err(value_error)?;
        let run = Run {
            frontend: self.frontend.clone(),
            request_id: request_id.clone(),
            events: self.events.clone(),
            tasks: self.tasks.clone(),
            stream,
            logprobs: checked.logprobs,
        };
        self.spawn_request(request_id, run.run(checked.specs, checked.n))
    }

    /// Up to `max_events` events, as a JSON array; waits up to `timeout` seconds (None:
    /// until one comes) for the first, with the GIL released. Ctrl-C interrupts the wait.
    #[pyo3(signature = (timeout = None, max_events = 4096))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>, max_events: usize) -> PyResult<String> {
        let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        loop {
            let wait = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(SIGNAL_POLL),
                None => SIGNAL_POLL,
            };
            let out = py.allow_threads(|| self.take(wait, max_events))?;
            if !out.is_empty() || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(Value::Array(out).to_string());
            }
            py.check_signals()?;
        }
    }

    /// Ends a request (every choice of it): its slots and KV pages are freed, and its last
    /// event says `"aborted": true`. Unknown or finished ids are ignored.
    fn abort(&self, request_id: &str) -> PyResult<()> {
        if let Some(handle) = lock(&self.tasks)?.remove(request_id) {
            handle.abort();
            let _ = self.events.send(done_event(request_id, true));
        }
        Ok(())
    }

    /// Whether the worker group still runs.
    #[getter]
    fn healthy(&self) -> bool {
        self.frontend.engine.is_healthy()
    }

    /// The tokenizer's encoding of `text` (with its special tokens), as the completions route
    /// encodes a text prompt.
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        self.frontend
            .tokenizer
            .encode(text, true)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// The text of token ids (vLLM's `RequestOutput.prompt` of a chat, `Logprob.decoded_token`).
    #[pyo3(signature = (ids, skip_special_tokens = false))]
    fn decode(&self, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        self.frontend
            .tokenizer
            .decode(&ids, skip_special_tokens)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Requests in flight.
    fn in_flight(&self) -> PyResult<usize> {
        Ok(lock(&self.tasks)?.len())
    }

    /// Aborts what runs, stops the engine threads (which closes and unlinks the worker
    /// channels, so the workers exit). Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let handles: Vec<_> = lock(&self.tasks)?.drain().collect();
        for (id, handle) in handles {
            handle.abort();
            let _ = self.events.send(done_event(&id, true));
        }
        let runtime = lock(&self.runtime)?.take();
        let engine = &self.frontend.engine;
        py.allow_threads(|| {
            engine.shutdown();
            if !engine.wait_stopped(Duration::from_secs(10)) {
                tracing::warn!("the engine thread did not stop within 10s");
            }
            if let Some(rt) = runtime {
                rt.shutdown_timeout(Duration::from_secs(1));
            }
        });
        ENGINE_RUNNING.store(false, Ordering::SeqCst);
        Ok(())
    }
}

impl Engine {
    /// Waits up to `wait` for one event, then takes what else is queued (up to `max`).
    fn take(&self, wait: Duration, max: usize) -> PyResult<Vec<Value>> {
        let outputs = lock(&self.outputs)?;
        let mut out = Vec::new();
        if let Ok(event) = outputs.recv_timeout(wait) {
            out.push(event);
            while out.len() < max {
                match outputs.try_recv() {
                    Ok(event) => out.push(event),
                    Err(_) => break,
                }
            }
        }
        Ok(out)
    }

    fn start_inner(
        py: Python<'_>,
        config_json: &str,
        channels: &Bound<'_, PyAny>,
        log_level: &str,
    ) -> PyResult<Self> {
        let (config, links) = crate::server::take_links(config_json, channels)?;
        tokenspeed_server::init_logging(log_level);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("tokenspeed-engine-io")
            .build()
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let state = py
            .allow_threads(|| tokenspeed_server::start_in_process(config, links, &runtime))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let (events, outputs) = mpsc::channel();
        Ok(Engine {
            runtime: Mutex::new(Some(runtime)),
            frontend: state.frontend.clone(),
            events,
            outputs: Mutex::new(outputs),
            tasks: Arc::default(),
            closed: AtomicBool::new(false),
        })
    }

    /// Starts a pooling request: its one event carries the route's whole answer (`response`).
    fn submit_pooling(&self, request_id: String, body: PoolingBody) -> PyResult<()> {
        let (fe, events, all) = (
            self.frontend.clone(),
            self.events.clone(),
            self.tasks.clone(),
        );
        let rid = request_id.clone();
        self.spawn_request(request_id, async move {
            let event = match body.answer(&fe).await {
                Ok(response) => json!({"request_id": rid, "response": response}),
                Err(e) => api_error_event(&rid, &e),
            };
            let _ = events.send(event);
            if all
                .lock()
                .map(|mut t| t.remove(&rid).is_some())
                .unwrap_or(false)
            {
                let _ = events.send(done_event(&rid, false));
            }
        })
    }

    /// Runs a request's task under its id (a duplicate id in flight is refused); `abort` and
    /// `shutdown` end it through the handle kept here, and the task removes itself at its end.
    fn spawn_request(
        &self,
        request_id: String,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> PyResult<()> {
        let mut tasks = lock(&self.tasks)?;
        if tasks.contains_key(&request_id) {
            return Err(PyValueError::new_err(format!(
                "request id {request_id:?} is already in flight"
            )));
        }
        let runtime = lock(&self.runtime)?;
        let runtime = runtime
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the engine was shut down"))?;
        // The map's lock is held until the handle is in, so the task cannot remove itself first.
        let handle = runtime.spawn(task);
        tasks.insert(request_id, handle.abort_handle());
        Ok(())
    }

    /// The server's own parse and validation of a completions or chat body.
    fn check(&self, kind: &str, body: &str) -> Result<Checked, RequestError> {
        let fe = &self.frontend;
        let vocab = fe.tokenizer.vocab_size() as u32;
        let defaults = &fe.config.sampling_defaults;
        let cap = fe.config.max_logprobs;
        match kind {
            "completion" => {
                let req: CompletionRequest = parse(body)?;
                known_fields("CompletionRequest", &req.extra)?;
                let v = validate::routes::completion_request(&req, defaults, vocab, cap)?;
                Ok(Checked {
                    specs: v.specs,
                    n: v.n,
                    logprobs: v.want_logprobs,
                })
            }
            "chat" => {
                let req: ChatCompletionRequest = parse(body)?;
                known_fields("ChatCompletionRequest", &req.extra)?;
                let v = validate::chat::chat_request(&req, defaults, vocab, cap, &fe.chat_parsers)?;
                Ok(Checked {
                    specs: vec![v.spec],
                    n: v.n,
                    logprobs: v.want_logprobs,
                })
            }
            other => Err(RequestError::bad_request(format!(
                "unknown request kind {other:?} (completion, chat, embeddings, score, classify)"
            ))),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if !self.closed.load(Ordering::SeqCst) {
            Python::with_gil(|py| {
                let _ = self.shutdown(py);
            });
        }
    }
}

/// A body of a pooling route (`kind` "embeddings", "score" or "classify"), parsed and checked
/// as the route does.
enum PoolingBody {
    Embeddings(EmbeddingRequest),
    Score(ScoreRequest),
    Classify(ClassifyRequest),
}

impl PoolingBody {
    /// None: `kind` is not a pooling one.
    fn parse(kind: &str, body: &str) -> Result<Option<PoolingBody>, RequestError> {
        Ok(Some(match kind {
            "embeddings" => {
                let req: EmbeddingRequest = parse(body)?;
                known_fields("EmbeddingRequest", &req.extra)?;
                PoolingBody::Embeddings(req)
            }
            "score" => {
                let req: ScoreRequest = parse(body)?;
                known_fields("ScoreRequest", &req.extra)?;
                PoolingBody::Score(req)
            }
            "classify" => {
                let req: ClassifyRequest = parse(body)?;
                known_fields("ClassifyRequest", &req.extra)?;
                PoolingBody::Classify(req)
            }
            _ => return Ok(None),
        }))
    }

    async fn answer(&self, fe: &Frontend) -> Result<Value, ApiError> {
        match self {
            PoolingBody::Embeddings(r) => http_pooling::embeddings_response(fe, r).await,
            PoolingBody::Score(r) => http_pooling::score_response(fe, r).await,
            PoolingBody::Classify(r) => http_pooling::classify_response(fe, r).await,
        }
    }
}

/// One request's task: start its choices, forward their chunks as events, then its `done`.
struct Run {
    frontend: Arc<Frontend>,
    request_id: String,
    events: mpsc::Sender<Value>,
    tasks: Tasks,
    stream: bool,
    logprobs: bool,
}

impl Run {
    async fn run(self, specs: Vec<GenerationSpec>, n: usize) {
        let id = generate::new_request_id();
        match generate::start_choices(&self.frontend, id, specs, n).await {
            Err(e) => self.send(error_event(&self.request_id, &e)),
            Ok(choices) => {
                let prompts = choices.prompts.clone();
                let mut acc = vec![Chunk::default(); choices.gens.len()];
                let mut first = vec![true; choices.gens.len()];
                let mut stream = std::pin::pin!(choices.stream());
                while let Some((i, item)) = stream.next().await {
                    let chunk = match item {
                        Ok(c) => c,
                        Err(e) => {
                            self.send(error_event(&self.request_id, &e));
                            break;
                        }
                    };
                    let prompt = prompts.get(i / n.max(1)).map(Vec::as_slice);
                    if self.stream {
                        let ids = std::mem::take(&mut first[i]).then_some(prompt).flatten();
                        self.send(self.chunk_event(i, &chunk, ids));
                    } else {
                        merge(&mut acc[i], chunk);
                        if acc[i].finish.is_some() {
                            self.send(self.chunk_event(i, &acc[i], prompt));
                        }
                    }
                }
            }
        }
        let ours = self
            .tasks
            .lock()
            .map(|mut t| t.remove(&self.request_id).is_some())
            .unwrap_or(false);
        if ours {
            self.send(done_event(&self.request_id, false));
        }
    }

    fn send(&self, event: Value) {
        let _ = self.events.send(event);
    }

    /// A choice's output: `index` (choice i of the request: prompt i / n, sample i % n), its
    /// text and tokens, logprobs when asked for, and at its end `finish_reason`.
    fn chunk_event(&self, index: usize, c: &Chunk, prompt_ids: Option<&[u32]>) -> Value {
        let mut e = json!({
            "request_id": self.request_id,
            "index": index,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish.as_ref().map(|f| f.reason),
            "stop_reason": c.finish.as_ref().and_then(|f| f.matched.clone()),
            "usage": c.usage,
        });
        if let Some(ids) = prompt_ids {
            e["prompt_token_ids"] = json!(ids);
        }
        if self.logprobs {
            e["logprobs"] = Value::Array(c.logprobs.iter().map(logprob_entry).collect());
        }
        if !c.prompt_logprobs.is_empty() {
            e["prompt_logprobs"] =
                Value::Array(c.prompt_logprobs.iter().map(logprob_entry).collect());
        }
        e
    }
}

/// `[token, logprob, rank | null, [[token, logprob], ...]]`.
fn logprob_entry(l: &TokenLogprob) -> Value {
    json!([l.token, l.logprob, l.rank, l.top])
}

fn merge(acc: &mut Chunk, c: Chunk) {
    acc.text.push_str(&c.text);
    acc.token_ids.extend(c.token_ids);
    acc.logprobs.extend(c.logprobs);
    acc.prompt_logprobs.extend(c.prompt_logprobs);
    acc.usage = c.usage;
    acc.finish = c.finish;
}

fn done_event(request_id: &str, aborted: bool) -> Value {
    json!({"request_id": request_id, "done": true, "aborted": aborted})
}

fn error_event(request_id: &str, e: &RequestError) -> Value {
    let kind = match e {
        RequestError::Invalid { .. } => "invalid",
        RequestError::Overloaded(_) => "overloaded",
        RequestError::Unavailable(_) => "unavailable",
        RequestError::Internal(_) => "internal",
    };
    json!({"request_id": request_id, "error": {"kind": kind, "message": e.to_string(),
                                                "param": e.param()}})
}

/// An error of a pooling route, as `error_event` words a request's.
fn api_error_event(request_id: &str, e: &ApiError) -> Value {
    let kind = match e.status.as_u16() {
        400..=499 if e.status.as_u16() != 429 => "invalid",
        429 => "overloaded",
        503 => "unavailable",
        _ => "internal",
    };
    json!({"request_id": request_id, "error": {"kind": kind, "message": e.message,
                                                "param": e.param}})
}

fn parse<T: serde::de::DeserializeOwned>(body: &str) -> Result<T, RequestError> {
    serde_json::from_str(body).map_err(|e| RequestError::bad_request(e.to_string()))
}

/// Fields the server refuses are refused here too; others no API defines are warned about once,
/// as the server does.
fn known_fields(schema: &str, extra: &Map<String, Value>) -> Result<(), RequestError> {
    check_extra_fields("offline engine", schema, extra)
        .map_err(|e| RequestError::bad_param(e.param.as_deref().unwrap_or(""), e.message))
}

fn value_error(e: RequestError) -> PyErr {
    match e.param() {
        Some(p) if !p.is_empty() => PyValueError::new_err(format!("{p}: {e}")),
        _ => PyValueError::new_err(e.to_string()),
    }
}

fn lock<T>(m: &Mutex<T>) -> PyResult<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| PyRuntimeError::new_err("engine lock poisoned"))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()
}
