//! The pooling routes of an `--is-embedding` server: OpenAI `/v1/embeddings`, vLLM's
//! `/v1/score`, the Cohere/Jina-shaped `/v1/rerank` (and `/rerank`), and `/classify`. Thin
//! adapters: the body types here, the rules in `validate/pooling.rs`, the engine requests in
//! `pooling.rs`. The `*_response` functions answer a parsed body on a `Frontend`, so the
//! offline engine (`tokenspeed.LLM.embed`, `rust/py`) gives the routes' answers too.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use utoipa::ToSchema;

use super::error::ApiError;
use super::protocol::{check_extra_fields, parse_body};
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::response::ErrorResponse;
use super::{ok_json, unix_now, AppState};
use crate::frontend::Frontend;
use crate::generate::{new_request_id, Prompt};
use crate::pooling::{self, PoolInput, Pooled};
use crate::validate::pooling::{self as rules, PoolingModel};

/// `input` of `/v1/embeddings`: text, texts, token ids, or batches of token ids.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdBatches(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub input: EmbeddingInput,
    /// "float" (default) or "base64" (little-endian float32 bytes).
    pub encoding_format: Option<String>,
    /// Matryoshka: the first this many dimensions, scaled back to unit length.
    pub dimensions: Option<u32>,
    pub user: Option<String>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// A text or a list of texts.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum TextOrTexts {
    One(String),
    Many(Vec<String>),
}

impl TextOrTexts {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            TextOrTexts::One(t) => vec![t],
            TextOrTexts::Many(v) => v,
        }
    }
}

/// vLLM's `/v1/score`: `text_1` against each of `text_2` (or pairwise for equal lists).
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ScoreRequest {
    pub model: Option<String>,
    pub text_1: TextOrTexts,
    pub text_2: TextOrTexts,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// A document to rerank: text, or `{"text": ...}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum DocumentField {
    Text(String),
    Object { text: String },
}

/// `/v1/rerank` (Cohere / Jina shape, as vLLM serves it).
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct RerankRequest {
    pub model: Option<String>,
    pub query: String,
    pub documents: Vec<DocumentField>,
    pub top_n: Option<u32>,
    /// Echo each result's document (default true).
    pub return_documents: Option<bool>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// `/classify`: a classifier's label probabilities per text.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ClassifyRequest {
    pub model: Option<String>,
    pub input: TextOrTexts,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

fn model_kind(fe: &Frontend) -> PoolingModel {
    PoolingModel::of(&fe.config.pooling_labels)
}

fn usage(pooled: &[Pooled]) -> Value {
    let tokens: u32 = pooled.iter().map(|p| p.prompt_tokens).sum();
    json!({"prompt_tokens": tokens, "total_tokens": tokens})
}

fn respond(result: Result<Value, ApiError>) -> Response {
    match result {
        Ok(v) => ok_json(v),
        Err(e) => e.into_response(),
    }
}

// --- /v1/embeddings --------------------------------------------------------------------------

#[utoipa::path(post, path = "/v1/embeddings", request_body = EmbeddingRequest, responses((status = 200, description = "one embedding per input, in order (OpenAI's list of embedding objects)")))]
pub async fn embeddings(State(state): State<AppState>, body: Bytes) -> Response {
    respond(embeddings_inner(state, &body).await)
}

async fn embeddings_inner(state: AppState, body: &[u8]) -> Result<Value, ApiError> {
    let req: EmbeddingRequest = parse_body(body)?;
    check_extra_fields("/v1/embeddings", "EmbeddingRequest", &req.extra)?;
    state.check_model(req.model.as_deref())?;
    embeddings_response(&state, &req).await
}

/// `/v1/embeddings`' answer to a parsed, model-checked body.
pub async fn embeddings_response(fe: &Frontend, req: &EmbeddingRequest) -> Result<Value, ApiError> {
    let checked = rules::embedding_request(req, model_kind(fe))?;
    let mut inputs = Vec::with_capacity(checked.prompts.len());
    for prompt in checked.prompts {
        inputs.push(pooling::tokenize(fe, prompt).await?);
    }
    let pooled = pooling::run(fe, inputs, None).await?;
    let mut data = Vec::with_capacity(pooled.len());
    for (i, p) in pooled.iter().enumerate() {
        rules::check_dimensions(checked.dimensions, p.vector.len())?;
        let mut v = p.vector.clone();
        if let Some(d) = checked.dimensions {
            v.truncate(d);
            pooling::normalize(&mut v);
        }
        let embedding = if checked.base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            Value::String(base64::encode(bytes))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    Ok(json!({
        "id": format!("embd-{}", new_request_id().request()),
        "object": "list",
        "created": unix_now(),
        "model": fe.config.served_model_name,
        "data": data,
        "usage": usage(&pooled),
    }))
}

// --- scores: /v1/score and /v1/rerank -------------------------------------------------------

/// One relevance score per (a, b) pair: a cross-encoder's sigmoid of its one logit, or an
/// embedding model's cosine of the two texts' embeddings. Also the usage of the inputs.
async fn pair_scores(
    fe: &Frontend,
    pairs: Vec<(String, String)>,
) -> Result<(Vec<f32>, Value), ApiError> {
    if model_kind(fe) == PoolingModel::Embedding {
        let n = pairs.len();
        let mut inputs: Vec<PoolInput> = Vec::with_capacity(2 * n);
        for (a, b) in pairs.iter().cloned() {
            inputs.push(pooling::tokenize(fe, Prompt::Text(a)).await?);
            inputs.push(pooling::tokenize(fe, Prompt::Text(b)).await?);
        }
        let pooled = pooling::run(fe, inputs, None).await?;
        let scores = pooled
            .chunks(2)
            .map(|ab| pooling::cosine(&ab[0].vector, &ab[1].vector))
            .collect();
        return Ok((scores, usage(&pooled)));
    }
    let mut inputs = Vec::with_capacity(pairs.len());
    for (a, b) in pairs {
        inputs.push(pooling::tokenize_pair(fe, a, b).await?);
    }
    let pooled = pooling::run(fe, inputs, None).await?;
    let scores = pooled
        .iter()
        .map(|p| p.vector.first().copied().map_or(0.0, pooling::sigmoid))
        .collect();
    Ok((scores, usage(&pooled)))
}

#[utoipa::path(post, path = "/v1/score", request_body = ScoreRequest, responses((status = 200, description = "one score per text pair, in order (vLLM's score response)")))]
pub async fn score(State(state): State<AppState>, body: Bytes) -> Response {
    respond(score_inner(state, &body).await)
}

async fn score_inner(state: AppState, body: &[u8]) -> Result<Value, ApiError> {
    let req: ScoreRequest = parse_body(body)?;
    check_extra_fields("/v1/score", "ScoreRequest", &req.extra)?;
    state.check_model(req.model.as_deref())?;
    score_response(&state, &req).await
}

/// `/v1/score`'s answer to a parsed, model-checked body.
pub async fn score_response(fe: &Frontend, req: &ScoreRequest) -> Result<Value, ApiError> {
    let pairs = rules::score_request(req, model_kind(fe))?;
    let (scores, usage) = pair_scores(fe, pairs).await?;
    let data: Vec<Value> = scores
        .iter()
        .enumerate()
        .map(|(i, s)| json!({"index": i, "object": "score", "score": s}))
        .collect();
    Ok(json!({
        "id": format!("score-{}", new_request_id().request()),
        "object": "list",
        "created": unix_now(),
        "model": fe.config.served_model_name,
        "data": data,
        "usage": usage,
    }))
}

#[utoipa::path(post, path = "/v1/rerank", request_body = RerankRequest, responses((status = 200, description = "the documents by relevance to the query, best first (Cohere/Jina shape)")))]
pub async fn rerank(State(state): State<AppState>, body: Bytes) -> Response {
    respond(rerank_inner(state, &body).await)
}

async fn rerank_inner(state: AppState, body: &[u8]) -> Result<Value, ApiError> {
    let req: RerankRequest = parse_body(body)?;
    check_extra_fields("/v1/rerank", "RerankRequest", &req.extra)?;
    state.check_model(req.model.as_deref())?;
    let checked = rules::rerank_request(&req, model_kind(&state))?;
    let pairs = checked
        .documents
        .iter()
        .map(|d| (req.query.clone(), d.clone()))
        .collect();
    let (scores, usage) = pair_scores(&state, pairs).await?;
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let results: Vec<Value> = order
        .into_iter()
        .take(checked.top_n)
        .map(|i| {
            let mut r = json!({"index": i, "relevance_score": scores[i]});
            if checked.return_documents {
                r["document"] = json!({"text": checked.documents[i]});
            }
            r
        })
        .collect();
    Ok(json!({
        "id": format!("rerank-{}", new_request_id().request()),
        "model": state.config.served_model_name,
        "usage": {"total_tokens": usage["total_tokens"]},
        "results": results,
    }))
}

// --- /classify -------------------------------------------------------------------------------

#[utoipa::path(post, path = "/classify", request_body = ClassifyRequest, responses((status = 200, description = "per text: the most likely label and every label's probability")))]
pub async fn classify(State(state): State<AppState>, body: Bytes) -> Response {
    respond(classify_inner(state, &body).await)
}

async fn classify_inner(state: AppState, body: &[u8]) -> Result<Value, ApiError> {
    let req: ClassifyRequest = parse_body(body)?;
    check_extra_fields("/classify", "ClassifyRequest", &req.extra)?;
    state.check_model(req.model.as_deref())?;
    classify_response(&state, &req).await
}

/// `/classify`'s answer to a parsed, model-checked body.
pub async fn classify_response(fe: &Frontend, req: &ClassifyRequest) -> Result<Value, ApiError> {
    let texts = rules::classify_request(req, model_kind(fe))?;
    let mut inputs = Vec::with_capacity(texts.len());
    for t in texts {
        inputs.push(pooling::tokenize(fe, Prompt::Text(t)).await?);
    }
    let pooled = pooling::run(fe, inputs, None).await?;
    let labels = &fe.config.pooling_labels;
    let data: Vec<Value> = pooled
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let probs = pooling::softmax(&p.vector);
            let best = (0..probs.len())
                .max_by(|&a, &b| probs[a].total_cmp(&probs[b]))
                .unwrap_or(0);
            json!({"index": i, "label": labels.get(best), "probs": probs,
                   "num_classes": probs.len()})
        })
        .collect();
    Ok(json!({
        "id": format!("classify-{}", new_request_id().request()),
        "object": "list",
        "created": unix_now(),
        "model": fe.config.served_model_name,
        "data": data,
        "usage": usage(&pooled),
    }))
}
